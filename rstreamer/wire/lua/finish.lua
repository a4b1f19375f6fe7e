#!lua flags=allow-oom
-- KEYS[1] dead-letter stream, KEYS[2..1+s] the request streams (priority levels) that entries
-- are acked on, then the r reply lists.
-- ARGV: group, s, number of dead letters, dead-letter max length, dead-letter max bytes, then per
-- request stream the number of ids to ack on it; then per reply list its TTL in ms, its number of
-- messages and the messages; then per dead letter its field count followed by its fields and
-- values; then the ids to ack and delete, stream by stream, each stream's newest last.
-- Replies, dead letters, XACK and XDEL in one script: no reply without its ack or the reverse. A
-- reply list whose token was withdrawn whole while the batch ran gets nothing: CANCEL turned its
-- key into a tombstone (a string, rstreamer.wire.cancel), which RPUSH refuses (WRONGTYPE). So a
-- batch asks nothing about withdrawals that do not exist: no EXISTS on the cancellation sets.
--- @include "include/checks.lua"
local group = ARGV[1]
local match, byte, sub = string.match, string.byte, string.sub
-- Every count and TTL first: a reply is never pushed for a batch whose ack would then fail. int:
-- quick_integer under pcall, then integer() to name what failed (include/checks.lua).
local function counts(int, argv, nkeys)
  local streams = int(argv[2], 0, nkeys - 1, 'number of request streams')
  local letters = int(argv[3], 0, #argv, 'number of dead letters')
  local dead_len = int(argv[4], 0, 2 ^ 53, 'dead-letter max length')
  local dead_bytes = int(argv[5], 0, 2 ^ 53, 'dead-letter max bytes')
  local a = 6 + streams
  for _ = 1, nkeys - 1 - streams do
    int(argv[a], 1, MAX_MS, 'reply TTL (ms)')
    a = a + 2 + int(argv[a + 1], 0, #argv, 'number of reply messages')
  end
  for _ = 1, letters do a = a + 1 + int(argv[a], 0, #argv, 'number of dead-letter fields') end
  for s = 1, streams do a = a + int(argv[5 + s], 0, #argv, 'number of acks') end
  int(a - 1, 0, #argv, 'number of arguments')
  return streams, letters, dead_len, dead_bytes
end
local checked, streams, letters, dead_len, dead_bytes = pcall(counts, quick_integer, ARGV, #KEYS)
if not checked then
  counts(integer, ARGV, #KEYS)
  error(streams)  -- not a count (out of memory, SCRIPT KILL): as it was raised
end
local replies = #KEYS - 1 - streams
-- The counts are integers now: + 0 reads them without tonumber()'s second strtod.
local a = 6 + streams
for k = 2 + streams, 1 + streams + replies do
  local ttl, n = ARGV[a], ARGV[a + 1] + 0
  -- pcall: a tombstone's WRONGTYPE means the caller is gone, and the script goes on to its acks.
  local pushed = redis.pcall('RPUSH', KEYS[k], unpack(ARGV, a + 2, a + 1 + n))
  if type(pushed) == 'number' then
    redis.call('PEXPIRE', KEYS[k], ttl)
  elseif not string.find(pushed['err'], '^WRONGTYPE') then
    return redis.error_reply(pushed['err'])
  end
  a = a + 2 + n
end
for _ = 1, letters do
  local n = ARGV[a] + 0
  redis.call('XADD', KEYS[1], '*', unpack(ARGV, a + 1, a + n))
  a = a + n + 1
end
if letters > 0 then
  redis.call('XTRIM', KEYS[1], 'MAXLEN', dead_len)
  -- Oldest first until the stream fits in dead_bytes; a record's fields understate what its
  -- removal frees, so this trims at least enough. The newest record always stays.
  local over = redis.call('MEMORY', 'USAGE', KEYS[1], 'SAMPLES', 0) - dead_bytes
  while over > 0 do
    local oldest = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 2)
    if #oldest < 2 then break end
    local size = 0
    for _, v in ipairs(oldest[1][2]) do size = size + #v end
    redis.call('XDEL', KEYS[1], oldest[1][1])
    over = over - size
  end
end
-- The id right after id, or nil when id is not 'ms-seq' in plain digits (no leading zero) with
-- both parts below 10^15 (then XDEL). One id per stream: the worker sorts, not the script.
local function after(id)
  local dash = match(id, '^[1-9]%d*()%-%d+$')
  local len = #id
  if not dash or dash > 16 or len - dash > 15 or (byte(id, dash + 1) == 48 and len > dash + 1) then
    return nil
  end
  return string.format('%d-%d', tonumber(sub(id, 1, dash - 1)), tonumber(sub(id, dash + 1)) + 1)
end
-- An acked entry leaves its stream (XLEN counts what waits). Several go at once by trimming the
-- stream up to the newest of them when no older entry is still pending: a group reads in id
-- order, so every entry older than one a worker read was read too, and one read and no longer
-- pending is done. XDEL seeks each id in its node; the trim walks the node once (16 ids: 135
-- against 8 us of Redis's CPU here; issue 26). Else, and for a single id, XDEL.
-- The newest is the last id of the stream's list (rstreamer.wire.stream_ids.newest_last): finding
-- it here took a pattern and a comparison per id, a quarter of FINISH (callgrind, issue 26). Were
-- it not the newest, the trim would stop short of the newer acked entries, which a later trim
-- takes: it never goes past an id this script acks, so it never takes an entry that waits.
for s = 1, streams do
  local stream, acks, first = KEYS[1 + s], ARGV[5 + s] + 0, a
  while acks > 0 do
    local n = math.min(acks, 1000)
    redis.call('XACK', stream, group, unpack(ARGV, a, a + n - 1))
    a, acks = a + n, acks - n
  end
  local newest = a - first > 1 and ARGV[a - 1]
  local bound = newest and after(newest)
  if bound and #redis.call('XPENDING', stream, group, '-', newest, 1) == 0 then
    redis.call('XTRIM', stream, 'MINID', bound)
  else
    for i = first, a - 1, 1000 do redis.call('XDEL', stream, unpack(ARGV, i, math.min(i + 999, a - 1))) end
  end
end
return 1
