-- KEYS[1] the token's cancellation set (keys.cancelled), KEYS[2] the request stream of the
-- call's priority level, KEYS[3..5] its held-item queue, held items and clocks, KEYS[6] the
-- token's reply list. ARGV: group, the set's TTL in ms, the tombstone's TTL in ms (0: not whole,
-- other calls share the token; else no other call does, so its replies may be dropped whole), n,
-- then n entry ids, then their n indexes.
-- Withdraws a caller's items (rstreamer.wire.cancel): an entry not yet delivered to a worker is deleted
-- (XDEL: no worker will ever read it); one a worker holds is marked in the set, which the worker
-- checks before predict. One script, so an entry is either deleted before any worker reads it or
-- marked: never both, never neither. A held item (id 'token:index', fair sharing) still held is
-- deleted, and its tenant's turns do not count it (withdraw); one already moved to the stream is
-- marked (its stream id is not known here), so a worker that reads it skips it.
-- Withdrawn whole with items a worker holds ('*' in the set), the reply list becomes a tombstone:
-- a string with its own TTL, which frees what was pushed and which FINISH's RPUSH refuses, so no
-- reply is written for a caller that is gone (and no batch pays to ask whether one is).
-- Returns {entries deleted, then the indexes of the entries marked (held by a worker)}.
--- @include "include/fair.lua"
local group = ARGV[1]
local ttl = integer(ARGV[2], 1, MAX_MS, 'cancellation TTL (ms)')
local tombstone = integer(ARGV[3], 0, MAX_MS, 'tombstone TTL (ms)')
local n = integer(ARGV[4], 0, (#ARGV - 4) / 2, 'number of entries')
local reply = {0}
local withdrawn = {}
local deleted = 0  -- entries deleted from the stream (not held items)
for i = 1, n do
  local id, index = ARGV[4 + i], ARGV[4 + n + i]
  local held = not string.match(id, '^%d+%-%d+$')
  local pending = not held and redis.pcall('XPENDING', KEYS[2], group, id, id, 1)
  if held then
    local tag = redis.call('ZSCORE', KEYS[3], id)
    if tag and redis.call('ZREM', KEYS[3], id) == 1 then
      local record = redis.call('HGET', KEYS[4], id)
      if record then withdrawn[#withdrawn + 1] = {tonumber(tag), cmsgpack.unpack(record)[3]} end
      redis.call('HDEL', KEYS[4], id)
      reply[1] = reply[1] + 1
    else
      redis.call('SADD', KEYS[1], index)
      reply[#reply + 1] = tonumber(index)
    end
  elseif type(pending) == 'table' and pending[1] then
    redis.call('SADD', KEYS[1], index)
    reply[#reply + 1] = tonumber(index)
  else
    local gone = redis.call('XDEL', KEYS[2], id)
    reply[1], deleted = reply[1] + gone, deleted + gone
  end
end
-- Latest first, so that a withdrawn call at the tail of its tenant's items gives back all its turns.
table.sort(withdrawn, function(x, y) return x[1] > y[1] end)
for _, item in ipairs(withdrawn) do withdraw(KEYS[5], item[2], item[1]) end
-- Entries deleted from the stream of a level that holds items: items are held only while the
-- stream has one undelivered, whose read wakes a worker to move them (include/admission.lua,
-- add). When the deleted ones were the last, one held item takes their place, as a call that
-- holds onto an empty stream moves one: else the held items would wait for the next call, or for
-- a blocked worker's idle_block.
if deleted > 0 and redis.call('ZCARD', KEYS[3]) > 0 and undelivered(KEYS[2], group) == 0 then
  promote(KEYS[2], KEYS[3], KEYS[4], KEYS[5], 1, lazy_clock())
end
if #reply > 1 then
  if tombstone > 0 then
    redis.call('SADD', KEYS[1], '*')
    redis.call('SET', KEYS[6], 'withdrawn', 'PX', tombstone)
  end
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return reply
