"""Every Lua script rstreamer runs, in one place."""
from __future__ import annotations

# Admission and enqueue of the calls one client sends under one token (messages.enqueue_args
# builds the arguments, messages.Admission reads the reply). KEYS[1] request stream.
# ARGV: max_queue (items, 0 = no limit), max_queue_bytes (0 = no limit), admit_wait_permille,
# group, token, wire version, number of calls n, then n triples (item count, remaining timeout
# in ms, deadline on the client's wall clock in ms), then the payloads of every call in order.
# Each call is checked as if it came alone, one after another; the first one refused and the
# ones after it are not added, and the reply says why: {accepted, reason, detail} with reason
# 0 none, 1 undelivered backlog at max_queue (detail: items), 2 the stream's memory would exceed
# max_queue_bytes (detail: bytes), 3 the oldest undelivered entry has waited more than
# admit_wait_permille/1000 of the call's remaining timeout, so that a new item would not run in
# time (detail: its age in ms, on the server's clock like every entry id). Items are numbered
# across the calls. Check and add are one script, so concurrent callers cannot overshoot.
ENQUEUE_CALLS = """
local max_queue, max_bytes = tonumber(ARGV[1]), tonumber(ARGV[2])
local permille, group, token, version = tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local calls = tonumber(ARGV[7])
local backlog, queued_bytes, oldest_ms = 0, 0, nil
if redis.call('EXISTS', KEYS[1]) == 1 then
  backlog = redis.call('XLEN', KEYS[1])
  local first = '-'
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local info = {}
    for k = 1, #g, 2 do info[g[k]] = g[k + 1] end
    if info['name'] == group then
      backlog = backlog - info['pending']
      first = '(' .. info['last-delivered-id']
    end
  end
  if backlog > 0 then
    local head = redis.call('XRANGE', KEYS[1], first, '+', 'COUNT', 1)
    if head[1] then oldest_ms = tonumber(string.match(head[1][1], '^(%d+)')) end
  end
  if max_bytes > 0 then queued_bytes = redis.call('MEMORY', 'USAGE', KEYS[1], 'SAMPLES', 0) end
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local age = 0
if oldest_ms then age = math.max(0, now_ms - oldest_ms) end
local payload = 8 + 3 * calls
local traced = payload  -- optional: one W3C traceparent per call after the payloads ('' = none)
for c = 1, calls do traced = traced + tonumber(ARGV[5 + 3 * c]) end
local index = 0
for c = 1, calls do
  local size, remaining, deadline = tonumber(ARGV[5 + 3 * c]), ARGV[6 + 3 * c], ARGV[7 + 3 * c]
  local tp = ARGV[traced + c - 1]
  local bytes = 0
  for k = payload, payload + size - 1 do bytes = bytes + #ARGV[k] end
  if max_queue > 0 and backlog + size > max_queue then return {c - 1, 1, backlog} end
  if max_bytes > 0 and queued_bytes + bytes > max_bytes then return {c - 1, 2, queued_bytes} end
  if age * 1000 > permille * tonumber(remaining) then return {c - 1, 3, age} end
  for _ = 1, size do
    if tp and tp ~= '' then
      redis.call('XADD', KEYS[1], '*', 'v', version, 't', token, 'i', index, 'r', remaining,
                 'd', deadline, 'p', ARGV[payload], 'tp', tp)
    else
      redis.call('XADD', KEYS[1], '*', 'v', version, 't', token, 'i', index, 'r', remaining,
                 'd', deadline, 'p', ARGV[payload])
    end
    index = index + 1
    payload = payload + 1
  end
  backlog = backlog + size
  queued_bytes = queued_bytes + bytes
end
return {calls, 0, 0}
"""

# KEYS[1] workers hash. ARGV: consumer name, JSON info, key TTL in ms.
# The server's clock stamps the beat, so liveness never depends on clocks agreeing. allow-oom
# (see FINISH below): a worker at maxmemory must not look dead and be robbed.
HEARTBEAT = """#!lua flags=allow-oom
local now = redis.call('TIME')
local info = cjson.decode(ARGV[2])
info['seen_ms'] = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(info))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return info['seen_ms']
"""

# KEYS[1] workers hash. Returns {seconds, microseconds, {field, value, ...}}.
# TIME and HGETALL in one script: the clock read is that of the server that stamped the beats,
# which on Redis Cluster a keyless TIME in a pipeline could not promise.
READ_WORKERS = """
local now = redis.call('TIME')
return {now[1], now[2], redis.call('HGETALL', KEYS[1])}
"""

# Durable jobs (rstreamer.jobs, rstreamer.job_sink). A job is a hash (state, total, done,
# failed, fed, window, level, created, expires, ttl, meta), a list of the encoded items not fed
# yet, a hash of answers by index and a log stream of the indexes answered, in order. The
# scripts below share these helpers (concatenated in front of each): feeding, completion and
# events are each one atomic step, so any process may run them and none needs a lease.
_JOB_HELPERS = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Keep a shared key alive at least ttl ms (it holds the newest job's data too).
local function extend(key, ttl)
  if redis.call('PTTL', key) < tonumber(ttl) then redis.call('PEXPIRE', key, ttl) end
end
local function event(events, kind, id, job)
  local f = redis.call('HMGET', job, 'done', 'failed', 'total', 'ttl')
  redis.call('XADD', events, 'MAXLEN', '~', 10000, '*', 'type', kind, 'job', id,
             'done', f[1], 'failed', f[2], 'total', f[3], 'at', now_ms())
  extend(events, f[4])
end
-- Top the job's items on the request stream up to its window, from the inputs list.
local function feed(job, inputs, stream, token, version)
  local f = redis.call('HMGET', job, 'state', 'fed', 'done', 'failed', 'window', 'expires')
  if f[1] ~= 'queued' and f[1] ~= 'running' then return 0 end
  local fed = tonumber(f[2])
  local room = tonumber(f[5]) - (fed - tonumber(f[3]) - tonumber(f[4]))
  if room <= 0 then return 0 end
  local items = redis.call('LPOP', inputs, room)
  if not items then return 0 end
  local remaining = math.max(0, tonumber(f[6]) - now_ms())
  for k, p in ipairs(items) do
    redis.call('XADD', stream, '*', 'v', version, 't', token, 'i', fed + k - 1, 'r', remaining, 'd', f[6], 'p', p)
  end
  redis.call('HINCRBY', job, 'fed', #items)
  return #items
end
-- A job with a webhook: one delivery for the workers' webhook senders (rstreamer.webhooks).
local function hook(hooks, kind, id, job)
  local url = redis.call('HGET', job, 'webhook')
  if url and url ~= '' then
    local f = redis.call('HMGET', job, 'done', 'failed', 'total')
    redis.call('XADD', hooks, '*', 'type', kind, 'job', id, 'url', url, 'done', f[1], 'failed', f[2],
               'total', f[3], 'at', now_ms())
  end
end
-- Every item answered: the job is done (or failed when an item failed); tell the followers.
local function complete(job, log, events, hooks, id)
  local f = redis.call('HMGET', job, 'total', 'done', 'failed', 'expires')
  if tonumber(f[2]) + tonumber(f[3]) < tonumber(f[1]) then return false end
  local state = 'done'
  if tonumber(f[3]) > 0 then state = 'failed' end
  redis.call('HSET', job, 'state', state, 'finished', now_ms())
  redis.call('XADD', log, '*', 'end', state)
  redis.call('PEXPIREAT', log, f[4])
  event(events, 'job.' .. state, id, job)
  hook(hooks, 'job.' .. state, id, job)
  return true
end
"""

# KEYS: job, inputs, jobs index, log, events, request stream, webhooks stream. ARGV: id, token,
# wire version, total, ttl ms, window, level ('' = least urgent), meta (JSON), webhook URL ('').
# The inputs were uploaded before (with the TTL). Returns 1, -1 when the id exists, -2 when
# the inputs are incomplete.
JOB_CREATE = _JOB_HELPERS + """
local job, inputs, index, log, events, stream = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local id, token, version, total, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
if redis.call('EXISTS', job) == 1 then return -1 end
if redis.call('LLEN', inputs) ~= total then return -2 end
local now = now_ms()
local expires = now + tonumber(ttl)
redis.call('HSET', job, 'state', 'queued', 'total', total, 'done', 0, 'failed', 0, 'fed', 0,
           'window', ARGV[6], 'level', ARGV[7], 'meta', ARGV[8], 'webhook', ARGV[9], 'created', now,
           'expires', expires, 'ttl', ttl)
redis.call('PEXPIREAT', job, expires)
if total > 0 then redis.call('PEXPIREAT', inputs, expires) end
redis.call('ZREMRANGEBYSCORE', index, '-inf', now)
redis.call('ZADD', index, expires, id)
extend(index, ttl)
if not complete(job, log, events, KEYS[7], id) then feed(job, inputs, stream, token, version) end
return 1
"""

# KEYS: job, inputs, request stream. ARGV: token, wire version. Returns the items fed.
JOB_FEED = _JOB_HELPERS + """
return feed(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2])
"""

# KEYS: job hashes. Returns, per job, {state, level} ('' for a job that no longer exists);
# a queued job becomes running. Run by a worker before it predicts: items of a job that was
# cancelled, expired or purged are not run.
JOB_ADMIT = "#!lua flags=allow-oom\n" + _JOB_HELPERS + """
local out = {}
for k, job in ipairs(KEYS) do
  local f = redis.call('HMGET', job, 'state', 'level')
  if f[1] == 'queued' then
    redis.call('HSET', job, 'state', 'running', 'started', now_ms())
    f[1] = 'running'
  end
  out[k] = {f[1] or '', f[2] or ''}
end
return out
"""

# KEYS: job, results, inputs, log, events, request stream, webhooks stream. ARGV: id, token, wire version,
# then per answer: index, ok (1/0), reply message. The first answer of an index is kept
# (HSETNX) and only it counts, so a redelivered item is recorded once. Then the job is
# completed, or fed as many new items as were answered. Returns the answers recorded. allow-oom
# like FINISH (below): a worker at maxmemory must still record what it ran.
JOB_RECORD = "#!lua flags=allow-oom\n" + _JOB_HELPERS + """
local job, results, inputs, log, events, stream = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local f = redis.call('HMGET', job, 'state', 'total', 'expires')
if f[1] ~= 'queued' and f[1] ~= 'running' then return 0 end
local total = tonumber(f[2])
local ok, failed, indexes = 0, 0, {}
for a = 4, #ARGV, 3 do
  local i = tonumber(ARGV[a])
  if i and i >= 0 and i < total and redis.call('HSETNX', results, ARGV[a], ARGV[a + 2]) == 1 then
    if ARGV[a + 1] == '1' then ok = ok + 1 else failed = failed + 1 end
    indexes[#indexes + 1] = ARGV[a]
  end
end
if #indexes == 0 then return 0 end
redis.call('PEXPIREAT', results, f[3])
redis.call('HINCRBY', job, 'done', ok)
redis.call('HINCRBY', job, 'failed', failed)
if f[1] == 'queued' then redis.call('HSET', job, 'state', 'running', 'started', now_ms()) end
redis.call('XADD', log, '*', 'i', table.concat(indexes, ','))
redis.call('PEXPIREAT', log, f[3])
if not complete(job, log, events, KEYS[7], ARGV[1]) then feed(job, inputs, stream, ARGV[2], ARGV[3]) end
return #indexes
"""

# KEYS: job, inputs, log, events, webhooks stream. ARGV: id. Returns 1 cancelled, 0 already
# finished, -1 unknown.
# The items not fed yet are dropped; the workers skip those already fed (JOB_ADMIT).
JOB_CANCEL = _JOB_HELPERS + """
local f = redis.call('HMGET', KEYS[1], 'state', 'expires')
if not f[1] then return -1 end
if f[1] ~= 'queued' and f[1] ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finished', now_ms())
redis.call('DEL', KEYS[2])
redis.call('XADD', KEYS[3], '*', 'end', 'cancelled')
redis.call('PEXPIREAT', KEYS[3], f[2])
event(KEYS[4], 'job.cancelled', ARGV[1], KEYS[1])
hook(KEYS[5], 'job.cancelled', ARGV[1], KEYS[1])
return 1
"""

# The worker's scripts below carry `#!lua flags=allow-oom` (Redis 7): Redis refuses every
# command of a MULTI, and every memory-growing command of a script without the flag, once used
# memory is over maxmemory. A worker must still be able to answer, ack and delete then, or the
# queue that filled Redis could never drain: deleting answered entries is what frees memory.
# The overshoot is bounded by what one call of a script writes (one batch's replies and dead
# letters, one heartbeat, one consumer group).

# KEYS[1] request stream, KEYS[2] dead-letter stream, KEYS[3..] reply lists.
# ARGV: group, number of ids to ack, number of dead letters, dead-letter max length, dead-letter
# max bytes; then per reply list its TTL in ms, its number of messages and the messages; then per
# dead letter its field count followed by its fields and values; then the ids to ack and delete.
# Replies, dead letters, XACK and XDEL in one script: no reply without its ack or the reverse.
FINISH = """#!lua flags=allow-oom
local group = ARGV[1]
local acks, letters = tonumber(ARGV[2]), tonumber(ARGV[3])
local dead_len, dead_bytes = tonumber(ARGV[4]), tonumber(ARGV[5])
local a = 6
for k = 3, #KEYS do
  local ttl, n = ARGV[a], tonumber(ARGV[a + 1])
  redis.call('RPUSH', KEYS[k], unpack(ARGV, a + 2, a + 1 + n))
  redis.call('PEXPIRE', KEYS[k], ttl)
  a = a + 2 + n
end
for _ = 1, letters do
  local n = tonumber(ARGV[a])
  redis.call('XADD', KEYS[2], '*', unpack(ARGV, a + 1, a + n))
  a = a + n + 1
end
if letters > 0 then
  redis.call('XTRIM', KEYS[2], 'MAXLEN', dead_len)
  -- Oldest first until the stream fits in dead_bytes; a record's fields understate what its
  -- removal frees, so this trims at least enough. The newest record always stays.
  local over = redis.call('MEMORY', 'USAGE', KEYS[2], 'SAMPLES', 0) - dead_bytes
  while over > 0 do
    local oldest = redis.call('XRANGE', KEYS[2], '-', '+', 'COUNT', 2)
    if #oldest < 2 then break end
    local size = 0
    for _, v in ipairs(oldest[1][2]) do size = size + #v end
    redis.call('XDEL', KEYS[2], oldest[1][1])
    over = over - size
  end
end
while acks > 0 do
  local n = math.min(acks, 1000)
  redis.call('XACK', KEYS[1], group, unpack(ARGV, a, a + n - 1))
  redis.call('XDEL', KEYS[1], unpack(ARGV, a, a + n - 1))
  a, acks = a + n, acks - n
end
return 1
"""

# KEYS[1] request stream. ARGV: group. Creates the stream and its group if missing.
ENSURE_GROUP = """#!lua flags=allow-oom
local reply = redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
if type(reply) == 'table' and reply.err and not string.find(reply.err, 'BUSYGROUP') then
  return redis.error_reply(reply.err)
end
return 1
"""

# KEYS[1] request stream. ARGV: group, consumer, exclusive start id ('-' for the first), count.
# This consumer's own pending entries after the start id, with their fields (nil for an entry
# deleted meanwhile). Read with XPENDING and XRANGE, not XREADGROUP from an id: re-reading
# one's own backlog after a failed reply is not a new delivery and must not count toward
# max_deliveries.
READ_OWN_PENDING = """
local start = ARGV[3]
if start ~= '-' then start = '(' .. start end
local rows = redis.call('XPENDING', KEYS[1], ARGV[1], start, '+', ARGV[4], ARGV[2])
local entries = {}
for i, row in ipairs(rows) do
  local found = redis.call('XRANGE', KEYS[1], row[1], row[1])
  entries[i] = {row[1], found[1] and found[1][2] or false}
end
return entries
"""

# KEYS[1] request stream, KEYS[2] workers hash. ARGV: group, consumer, dead_after ms.
# Remove a dead consumer only if, at this instant, it holds no entry and has not read for
# dead_after: a consumer that was stalled but is alive may read between a listing and the
# delete, and XGROUP DELCONSUMER would drop the entries it just read from every pending list.
# Returns 1 if removed.
FORGET_CONSUMER = """
for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for i = 1, #consumer, 2 do info[consumer[i]] = consumer[i + 1] end
  if info['name'] == ARGV[2] then
    if info['pending'] > 0 or info['idle'] <= tonumber(ARGV[3]) then return 0 end
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
    redis.call('HDEL', KEYS[2], ARGV[2])
    return 1
  end
end
return 0
"""
