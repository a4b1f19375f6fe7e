"""Every Lua script rstreamer runs, in one place."""
from __future__ import annotations

# Checks every script makes before it writes anything (issue 22). A Lua error does not roll back
# the writes made before it, so a script that failed half-way left half a state (a job hash
# without a TTL, an item held for a call its caller was told was refused). And Lua hands a number
# to a Redis command in the shortest form that reads back the same, "1e+17" from 1e17 on, which
# PEXPIRE and XADD's ids refuse: a script must never compute such a number. So every duration a
# script takes is an integer number of ms up to MAX_MS, checked first, and what it computes from
# them (the server's ms plus a duration, about 1.8e12) stays a plain integer.
_CHECKS = """
-- The longest duration (ms) any script accepts: 366 days (messages.MAX_DURATION_MS). The clients
-- and web apps refuse much less (messages.MAX_TIMEOUT, messages.MAX_JOB_TTL).
local MAX_MS = 31622400000
-- value as an integer from low to high; otherwise the script stops with an error, before it writes.
local function integer(value, low, high, what)
  local n = tonumber(value)
  if not n or n ~= math.floor(n) or n < low or n > high then
    error(redis.error_reply('ERR rstreamer: invalid ' .. what .. ': ' .. string.sub(tostring(value), 1, 40)))
  end
  return n
end
-- The server's time in ms.
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# Fair sharing between tenants of one level (``--tenant-sharing fair``; docs/priority.md).
# Each level then has, beside its stream, a sorted set of held items (member: the item's id
# 'token:index', score: its start tag in virtual time), a hash of their entries (member ->
# msgpack {held at ms, {field, value, ...}, tenant}) and a hash of virtual clocks ('~': the tag
# of the last item promoted; per tenant, '' for calls without one: the tag after its last item;
# '#' and the tenant: its items held; '*': the tenants with items held). This is
# start-time fair queueing: a tenant's next item starts at max(clock, its own finish tag), so
# every tenant with items waiting gets one item in turn, a newcomer goes next, and each tenant's
# items keep their order. Items move to the stream, fairest first, when a worker reads the level
# (READ_LEVELS) and, one, when a call arrives while the stream has nothing undelivered, which
# wakes workers blocked on the stream. A job's items are held and moved the same way.
_FAIR_HELPERS = _CHECKS + """
-- Hold count items of one call or job; the three keys live until the latest held item's
-- deadline has passed (ttl ms), so a prefix nobody serves any more forgets them.
local function hold(queue, items, clock, tenant, token, first, fields_of, count, now_ms, ttl)
  local start = math.max(tonumber(redis.call('HGET', clock, '~') or '0'),
                         tonumber(redis.call('HGET', clock, tenant) or '0'))
  for k = 0, count - 1 do
    local id = token .. ':' .. (first + k)
    redis.call('ZADD', queue, start + k, id)
    redis.call('HSET', items, id, cmsgpack.pack({now_ms, fields_of(k), tenant}))
  end
  redis.call('HSET', clock, tenant, start + count)
  if redis.call('HINCRBY', clock, '#' .. tenant, count) == count then redis.call('HINCRBY', clock, '*', 1) end
  for _, key in ipairs({queue, items, clock}) do
    if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  end
end
-- One held item of tenant is gone (moved to the stream or withdrawn).
local function release(clock, tenant)
  if redis.call('HINCRBY', clock, '#' .. tenant, -1) <= 0 then
    redis.call('HDEL', clock, '#' .. tenant)
    redis.call('HINCRBY', clock, '*', -1)
  end
end
-- A held item of tenant, of start tag tag, was withdrawn (its caller cancelled or timed out):
-- the tenant's turns must not count it (issue 22 #10). A tenant's calls take consecutive tags in
-- order, so when the item was the tenant's last one (its finish tag is the item's tag + 1) the
-- finish tag goes back to the item's; called for the withdrawn items latest first, a withdrawn
-- call at the tail of the tenant's items gives all its turns back. A tenant left holding
-- nothing forgets its finish tag: its items that ran were promoted, so their turns are past,
-- and its next call starts at the current turn, as a newcomer's.
local function withdraw(clock, tenant, tag)
  release(clock, tenant)
  if not redis.call('HGET', clock, '#' .. tenant) then redis.call('HDEL', clock, tenant)
  elseif tonumber(redis.call('HGET', clock, tenant) or '-1') == tag + 1 then redis.call('HSET', clock, tenant, tag) end
end
-- The items tenant holds, and how many tenants hold items.
local function holding(clock, tenant)
  local f = redis.call('HMGET', clock, '#' .. tenant, '*')
  return tonumber(f[1] or '0'), tonumber(f[2] or '0')
end
-- Move up to count held items, fairest first, onto the stream; their remaining timeout shrinks
-- by the time they were held (a version-2 entry counts it from its new id). Returns the count.
local function promote(stream, queue, items, clock, count, now_ms)
  local popped = redis.call('ZPOPMIN', queue, count)
  for i = 1, #popped, 2 do
    local record = redis.call('HGET', items, popped[i])
    if record then
      redis.call('HDEL', items, popped[i])
      local held = cmsgpack.unpack(record)
      local fields = held[2]
      for f = 1, #fields, 2 do
        if fields[f] == 'r' then fields[f + 1] = math.max(0, tonumber(fields[f + 1]) - (now_ms - held[1])) end
      end
      redis.call('XADD', stream, '*', unpack(fields))
      release(clock, held[3])
    end
  end
  -- Every tenant idle: the clocks start again (tags only order what waits).
  if redis.call('EXISTS', queue) == 0 then redis.call('DEL', clock, items)
  elseif #popped > 0 then redis.call('HSET', clock, '~', popped[#popped]) end
  return #popped / 2
end
-- When the first held item was held (ms), or nil.
local function held_since(queue, items)
  local head = redis.call('ZRANGE', queue, 0, 0)
  if not head[1] then return nil end
  local record = redis.call('HGET', items, head[1])
  return record and cmsgpack.unpack(record)[1]
end
"""

# What a call's admission and a job's feed share (ENQUEUE_CALLS, and feed in _JOB_HELPERS): the
# levels and quotas the workers published, a level's queue, its bound, a tenant's token bucket,
# the layout of a request entry and how items are added to a level. A job's items are admitted
# by the same rules as a call's, a window at a time (docs/jobs.md).
_ADMISSION_HELPERS = _FAIR_HELPERS + """
-- The levels the workers published (JSON {weights, max_queue, fair}; absent: one level, as
-- before priority levels): their number, their bounds, and whether they are shared fairly.
local function published_levels(key)
  local published = redis.call('GET', key)
  if not published then return 1, {}, false end
  local config = cjson.decode(published)
  return #config['weights'], config['max_queue'] or {}, config['fair'] == true
end
-- The tenant quotas the workers published (JSON {rate, burst, tenants}), or nil for none.
local function published_quotas(key)
  local published = redis.call('GET', key)
  return published and cjson.decode(published)
end
-- The bound of level l (1 = level 0): its published max_queue, else the caller's (0: none).
local function level_bound(bounds, l, max_queue)
  local limit = tonumber(bounds[l] or 0)
  if limit <= 0 then limit = max_queue end
  return limit
end
-- One level's queue (lk: its stream, held-item queue, held items, clocks): the items waiting
-- (held ones included with fair sharing), the items undelivered on its stream, the age in ms
-- of the oldest waiting one, and the bytes they take (counted only when count_bytes).
local function level_queue(lk, group, fair, count_bytes, now_ms)
  local backlog, age, bytes = 0, 0, 0
  if redis.call('EXISTS', lk[1]) == 1 then
    backlog = redis.call('XLEN', lk[1])
    local first = '-'
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', lk[1])) do
      local info = {}
      for k = 1, #g, 2 do info[g[k]] = g[k + 1] end
      if info['name'] == group then
        backlog = backlog - info['pending']
        first = '(' .. info['last-delivered-id']
      end
    end
    if backlog > 0 then
      local head = redis.call('XRANGE', lk[1], first, '+', 'COUNT', 1)
      if head[1] then age = math.max(0, now_ms - tonumber(string.match(head[1][1], '^(%d+)'))) end
    end
    if count_bytes then bytes = redis.call('MEMORY', 'USAGE', lk[1], 'SAMPLES', 0) end
  end
  local undelivered = backlog
  if fair then
    backlog = backlog + redis.call('ZCARD', lk[2])
    local since = held_since(lk[2], lk[3])
    if since then age = math.max(age, now_ms - since) end
    if count_bytes and since then bytes = bytes + redis.call('MEMORY', 'USAGE', lk[3], 'SAMPLES', 0) end
  end
  return backlog, undelivered, age, bytes
end
-- How many of need items tenant may add to a level whose bound is limit, with ahead items
-- waiting on it and the more urgent levels (clock: the level's clocks). A full fair level
-- still admits a tenant holding less than an equal share of the bound (the tenants holding
-- items, itself included), up to twice the bound: a tenant that filled the level does not shut
-- the others out.
local function room(clock, fair, tenant, ahead, limit, need)
  if limit <= 0 then return need end
  local free = limit - ahead
  if fair and free < need then
    local own, waiting = holding(clock, tenant)
    if own == 0 then waiting = waiting + 1 end
    free = math.max(free, math.min(math.floor(limit / math.max(1, waiting)) - own, 2 * limit - ahead))
  end
  return math.max(0, math.min(need, free))
end
-- The token bucket at key of tenant name: {rate, burst, tokens refilled to now}; rate 0 when
-- the tenant has no quota. A bucket (tokens, ms of the last refill) refills at rate items/s up
-- to burst.
local function bucket_of(quotas, name, key, now_ms)
  local rate, burst = 0, 0
  if quotas then
    local own = quotas['tenants'] and quotas['tenants'][name]
    if own then rate, burst = tonumber(own[1]), tonumber(own[2])
    else rate, burst = tonumber(quotas['rate']), tonumber(quotas['burst']) end
  end
  local b = {rate = rate, burst = burst, tokens = burst, key = key}
  if rate > 0 then
    local state = redis.call('HMGET', key, 'tokens', 'ms')
    if state[1] then
      local elapsed = math.max(0, now_ms - tonumber(state[2]))
      b.tokens = math.min(burst, tonumber(state[1]) + elapsed * rate / 1000)
    end
  end
  return b
end
-- Take n tokens of bucket b; the bucket lives as long as it takes to fill again.
local function take(b, n, now_ms)
  b.tokens = b.tokens - n
  redis.call('HSET', b.key, 'tokens', tostring(b.tokens), 'ms', now_ms)
  redis.call('PEXPIRE', b.key, math.min(MAX_MS, math.ceil(b.burst * 1000 / b.rate) + 1000))
end
-- The fields of one request entry, as messages.py documents them (tp: a W3C traceparent, or
-- nil or '' for none).
local function entry_fields(version, token, index, remaining, deadline, payload, tp)
  local fields = {'v', version, 't', token, 'i', index, 'r', remaining, 'd', deadline, 'p', payload}
  if tp and tp ~= '' then fields[13], fields[14] = 'tp', tp end
  return fields
end
-- Add count items of one call or job (fields_of(k): the entry of its k-th item, numbered from
-- first) to a level (lk as for level_queue): with fair sharing held, ids 'token:index', and
-- when the stream has nothing undelivered one moves to it at once, which wakes the workers;
-- otherwise onto the stream. Returns the ids added and the level's undelivered count after.
local function add(lk, fair, tenant, token, first, count, fields_of, remaining, undelivered, now_ms)
  local ids = {}
  if fair then
    hold(lk[2], lk[3], lk[4], tenant, token, first, fields_of, count, now_ms, remaining + 60000)
    for k = 0, count - 1 do ids[#ids + 1] = token .. ':' .. (first + k) end
    if undelivered == 0 then undelivered = promote(lk[1], lk[2], lk[3], lk[4], 1, now_ms) end
  else
    for k = 0, count - 1 do ids[#ids + 1] = redis.call('XADD', lk[1], '*', unpack(fields_of(k))) end
    undelivered = undelivered + count
  end
  return ids, undelivered
end
-- The four keys of level l (1 = level 0) in KEYS, the first level's starting at KEYS[at].
local function level_keys(at, l)
  local k = at + 4 * (l - 1)
  return {KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]}
end
"""

# Admission and enqueue of the calls one client sends under one token (messages.enqueue_args
# builds the arguments, messages.Admission reads the reply). KEYS[1] the levels the workers
# published (JSON {weights, max_queue}; absent: one level, as before priority levels), KEYS[2]
# the tenant quotas they published (JSON {rate, burst, tenants}; absent: no quotas), KEYS[3..2+t]
# the token buckets of the t tenants the calls name, then per level 0, 1, ... up to the highest
# level among the calls its request stream, held-item queue, held items and virtual clocks (see
# _FAIR_HELPERS; used when the levels say 'fair').
# ARGV: max_queue (items, 0 = no limit), max_queue_bytes (0 = no limit), admit_wait_permille,
# group, token, wire version, number of calls n, number of tenants t, then the t tenant names,
# then n quintuples (item count, remaining timeout in ms, deadline on the client's wall clock in
# ms, priority level, tenant number 1..t or 0 for none), then the payloads of every call in
# order, then optionally one W3C traceparent per call ('' = none). Every number is checked
# before anything is written (a remaining timeout up to MAX_MS).
# Each call is checked as if it came alone, one after another, and added or refused on its own
# (a bulk call refused never refuses an urgent call coalesced after it). The reply is {n, then
# per call its reason, detail and limit, then the ids of the entries added, in order (a caller
# withdraws them when it cancels)} with reason 0 added, 1 the undelivered backlog of the call's
# level and of the more urgent ones, plus the call's items, would exceed the level's bound
# (detail: the backlog in items; limit: the bound: the level's published max_queue, else the
# client's), 2 the streams' memory would exceed max_queue_bytes (detail: bytes), 3 the oldest
# undelivered entry of the call's level has waited more than admit_wait_permille/1000 of the
# call's remaining timeout, so that a new item would not run in time (detail: its age in ms, on
# the server's clock like every entry id), 4 the level is beyond the levels the workers serve
# (detail: their number of levels), 5 the tenant is over its quota (detail: ms until its bucket
# holds enough tokens, -1 when the call is larger than the burst; limit: the burst). Items are
# numbered across the calls, refused ones included (each call's answers go to its own offset).
# Counting the more urgent levels' backlog is what makes Overloaded hit the least urgent level
# first. A call takes one token per item of its tenant's bucket, only once every other check
# has passed. Check and add are one script, so concurrent callers cannot overshoot. With fair
# sharing the items are held (their ids are then 'token:index') and the backlog counts held
# items too.
ENQUEUE_CALLS = _ADMISSION_HELPERS + """
local max_queue = integer(ARGV[1], 0, math.huge, 'max_queue')
local max_bytes = integer(ARGV[2], 0, math.huge, 'max_queue_bytes')
local permille, group, token, version = integer(ARGV[3], 0, 1000, 'admit wait'), ARGV[4], ARGV[5], ARGV[6]
local calls, tenants = integer(ARGV[7], 0, #ARGV, 'number of calls'), integer(ARGV[8], 0, #KEYS, 'number of tenants')
local streams = (#KEYS - 2 - tenants) / 4
local payload = 9 + tenants + 5 * calls
-- Every call's numbers first: a call refused by these checks must not follow calls added.
local last = payload - 1
for c = 1, calls do
  local at = 4 + tenants + 5 * c
  last = last + integer(ARGV[at], 0, #ARGV, 'item count')
  integer(ARGV[at + 1], 0, MAX_MS, 'remaining timeout (ms)')
  integer(ARGV[at + 2], 0, 2 ^ 53, 'deadline (ms)')
  integer(ARGV[at + 3], 0, math.huge, 'priority level')
  integer(ARGV[at + 4], 0, tenants, 'tenant number')
end
integer(last, 0, #ARGV, 'number of payloads')
local levels, bounds, fair = published_levels(KEYS[1])
local quotas = published_quotas(KEYS[2])
local now_ms = server_ms()
local backlog, undelivered, age, queued_bytes = {}, {}, {}, 0
for l = 1, streams do
  local lk, bytes = level_keys(3 + tenants, l), 0
  backlog[l], undelivered[l], age[l], bytes = level_queue(lk, group, fair, max_bytes > 0, now_ms)
  queued_bytes = queued_bytes + bytes
end
local function tenant_name(number) return number > 0 and ARGV[8 + number] or '' end
-- tenant number -> its bucket (tokens refilled to now), read once per script
local buckets = {}
local function bucket(number)
  buckets[number] = buckets[number] or bucket_of(quotas, ARGV[8 + number], KEYS[2 + number], now_ms)
  return buckets[number]
end
local traced = payload
for c = 1, calls do traced = traced + tonumber(ARGV[4 + tenants + 5 * c]) end
local index = 0
local reply, ids = {calls}, {}
for c = 1, calls do
  local at = 4 + tenants + 5 * c
  local size, remaining, deadline = tonumber(ARGV[at]), tonumber(ARGV[at + 1]), ARGV[at + 2]
  local level, tenant = tonumber(ARGV[at + 3]), tonumber(ARGV[at + 4])
  local tp = ARGV[traced + c - 1]
  local reason, detail, limit = 0, 0, 0
  local b = nil
  local bytes = 0
  for k = payload, payload + size - 1 do bytes = bytes + #ARGV[k] end
  if level >= levels or level + 1 > streams then
    reason, detail = 4, levels
  elseif tenant > 0 and bucket(tenant).rate > 0 then
    b = bucket(tenant)
    if size > b.burst then reason, detail, limit = 5, -1, b.burst
    elseif b.tokens < size then reason, detail, limit = 5, math.ceil((size - b.tokens) * 1000 / b.rate), b.burst end
  end
  if reason == 0 then
    limit = level_bound(bounds, level + 1, max_queue)
    local ahead = 0
    for l = 1, level + 1 do ahead = ahead + backlog[l] end
    local lk = level_keys(3 + tenants, level + 1)
    if room(lk[4], fair, tenant_name(tenant), ahead, limit, size) < size then
      reason, detail = 1, ahead
    elseif max_bytes > 0 and queued_bytes + bytes > max_bytes then reason, detail, limit = 2, queued_bytes, max_bytes
    elseif age[level + 1] * 1000 > permille * remaining then reason, detail, limit = 3, age[level + 1], 0
    else limit = 0 end
  end
  if reason == 0 then
    if b then take(b, size, now_ms) end
    local function fields_of(k)
      return entry_fields(version, token, index + k, remaining, deadline, ARGV[payload + k], tp)
    end
    local added
    added, undelivered[level + 1] = add(level_keys(3 + tenants, level + 1), fair, tenant_name(tenant), token, index,
                                        size, fields_of, remaining, undelivered[level + 1], now_ms)
    for _, id in ipairs(added) do ids[#ids + 1] = id end
    backlog[level + 1] = backlog[level + 1] + size
    queued_bytes = queued_bytes + bytes
  end
  reply[#reply + 1] = reason
  reply[#reply + 1] = detail
  reply[#reply + 1] = limit
  index = index + size
  payload = payload + size
end
for _, id in ipairs(ids) do reply[#reply + 1] = id end
return reply
"""

# KEYS[1] workers hash. ARGV: consumer name, JSON info, key TTL in ms.
# The server's clock stamps the beat, so liveness never depends on clocks agreeing. allow-oom
# (see FINISH below): a worker at maxmemory must not look dead and be robbed.
HEARTBEAT = """#!lua flags=allow-oom""" + _CHECKS + """
local ttl = integer(ARGV[3], 1, MAX_MS, 'heartbeat TTL (ms)')
local info = cjson.decode(ARGV[2])
info['seen_ms'] = server_ms()
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(info))
redis.call('PEXPIRE', KEYS[1], ttl)
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
# failed, fed, window, level, tenant, max_queue, created, expires, ttl, meta), a list of the
# encoded items not fed yet, a hash of answers by index and a log stream of the indexes
# answered, in order. The scripts below share these helpers (concatenated in front of each):
# feeding, completion and events are each one atomic step, so any process may run them and none
# needs a lease. A job's items are fed by the admission rules of a call (_ADMISSION_HELPERS).
_JOB_HELPERS = _ADMISSION_HELPERS + """
local now_ms = server_ms
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
-- Whether the keys from KEYS[at] to the last are those of a job's feed (Keys.job_feed):
-- the published levels and quotas, the four keys of each level from 0 to the job's level, then
-- its tenant's bucket if it has a tenant.
local function feed_keys_fit(at, level, tenant)
  local bucket = 0
  if tenant ~= '' then bucket = 1 end
  return #KEYS - at + 1 == 2 + 4 * (level + 1) + bucket
end
-- Top the job's items on its level up to its window (the items fed and not answered), from
-- the inputs list, as far as the level's bound (with fair sharing, the tenant's equal share of
-- it; the items are held, and take turns with the calls') and the tenant's quota (one token per
-- item, taken as it is fed) let in. A job held back by either is listed in the sorted set
-- starved, due when its tenant's bucket has a token again, for the workers to feed
-- (JobSink.pump); one fed up to its window leaves it. at: where the feed keys start in KEYS;
-- group: the workers' consumer group. Returns the items fed, or -1, writing nothing, when the
-- keys are not the job's.
local function feed(job, inputs, starved, at, id, token, version, group)
  local f = redis.call('HMGET', job, 'state', 'fed', 'done', 'failed', 'window', 'expires', 'level', 'tenant',
                       'max_queue', 'ttl')
  if f[1] ~= 'queued' and f[1] ~= 'running' then
    redis.call('ZREM', starved, id)
    return 0
  end
  local level, tenant = tonumber(f[7]) or 0, f[8] or ''
  if not feed_keys_fit(at, level, tenant) then return -1 end
  local fed = tonumber(f[2])
  local want = math.min(tonumber(f[5]) - (fed - tonumber(f[3]) - tonumber(f[4])), redis.call('LLEN', inputs))
  if want <= 0 then
    redis.call('ZREM', starved, id)
    return 0
  end
  local now = now_ms()
  local _, bounds, fair = published_levels(KEYS[at])
  local ahead, undelivered = 0, 0
  for l = 1, level + 1 do
    local backlog
    backlog, undelivered = level_queue(level_keys(at + 2, l), group, fair, false, now)
    ahead = ahead + backlog
  end
  local lk = level_keys(at + 2, level + 1)
  local n = room(lk[4], fair, tenant, ahead, level_bound(bounds, level + 1, tonumber(f[9]) or 0), want)
  local b = nil
  if tenant ~= '' then
    b = bucket_of(published_quotas(KEYS[at + 1]), tenant, KEYS[#KEYS], now)
    if b.rate > 0 then n = math.min(n, math.floor(b.tokens)) else b = nil end
  end
  if n > 0 then
    local items = redis.call('LPOP', inputs, n)
    local remaining = math.max(0, tonumber(f[6]) - now)
    local function fields_of(k) return entry_fields(version, token, fed + k, remaining, f[6], items[k + 1]) end
    add(lk, fair, tenant, token, fed, n, fields_of, remaining, undelivered, now)
    redis.call('HINCRBY', job, 'fed', n)
    if b then take(b, n, now) end
  end
  if n < want then
    local due = now
    if b and b.tokens < 1 then due = now + math.ceil((1 - b.tokens) * 1000 / b.rate) end
    redis.call('ZADD', starved, due, id)
    extend(starved, f[10])
  else
    redis.call('ZREM', starved, id)
  end
  return n
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

# KEYS: job, inputs, jobs index, log, events, starved jobs, webhooks stream, then the feed keys
# (Keys.job_feed: the published levels and quotas, the keys of levels 0 to the job's,
# its tenant's bucket if it has one). ARGV: id, token, wire version, total, ttl ms, window, level,
# meta (JSON), webhook URL (''), tenant ('' = none), max_queue (the submitter's bound, 0 = none),
# the workers' consumer group. Every number is checked before anything is written.
# The inputs were uploaded before (with the TTL). Returns 1, -1 when the id exists, -2 when
# the inputs are incomplete.
JOB_CREATE = _JOB_HELPERS + """
local job, inputs, index, log, events, starved = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local id, token, version = ARGV[1], ARGV[2], ARGV[3]
local total = integer(ARGV[4], 0, 2 ^ 31, 'number of items')
local ttl = integer(ARGV[5], 1, MAX_MS, 'ttl (ms)')
local window = integer(ARGV[6], 1, 2 ^ 31, 'window')
local level = integer(ARGV[7], 0, 1000, 'priority level')
local max_queue = integer(ARGV[11], 0, 2 ^ 53, 'max_queue')
if ARGV[10] ~= '' and (#ARGV[10] > 100 or not string.match(ARGV[10], '^[%w_%.%-@]+$')) then
  return redis.error_reply('ERR rstreamer: invalid tenant')
end
if not feed_keys_fit(8, level, ARGV[10]) then
  return redis.error_reply("ERR rstreamer: the keys are not those of the job's level and tenant")
end
if redis.call('EXISTS', job) == 1 then return -1 end
if redis.call('LLEN', inputs) ~= total then return -2 end
local now = now_ms()
local expires = now + ttl
redis.call('HSET', job, 'state', 'queued', 'total', total, 'done', 0, 'failed', 0, 'fed', 0,
           'window', window, 'level', level, 'meta', ARGV[8], 'webhook', ARGV[9], 'tenant', ARGV[10],
           'max_queue', max_queue, 'created', now, 'expires', expires, 'ttl', ttl)
redis.call('PEXPIREAT', job, expires)
if total > 0 then redis.call('PEXPIREAT', inputs, expires) end
redis.call('ZREMRANGEBYSCORE', index, '-inf', now)
redis.call('ZADD', index, expires, id)
extend(index, ttl)
if not complete(job, log, events, KEYS[7], id) then feed(job, inputs, starved, 8, id, token, version, ARGV[12]) end
return 1
"""

# KEYS: job, inputs, starved jobs, then the feed keys (as JOB_CREATE). ARGV: id, token, wire
# version, the workers' consumer group. Returns the items fed (-1: the keys are not the job's).
JOB_FEED = _JOB_HELPERS + """
return feed(KEYS[1], KEYS[2], KEYS[3], 4, ARGV[1], ARGV[2], ARGV[3], ARGV[4])
"""

# KEYS: job hashes. Returns, per job, {state, level, tenant} ('' for a job that no longer
# exists); a queued job becomes running. Run by a worker before it predicts: items of a job
# that was cancelled, expired or purged are not run.
JOB_ADMIT = "#!lua flags=allow-oom\n" + _JOB_HELPERS + """
local out = {}
for k, job in ipairs(KEYS) do
  local f = redis.call('HMGET', job, 'state', 'level', 'tenant')
  if f[1] == 'queued' then
    redis.call('HSET', job, 'state', 'running', 'started', now_ms())
    f[1] = 'running'
  end
  out[k] = {f[1] or '', f[2] or '', f[3] or ''}
end
return out
"""

# KEYS: job, results, inputs, log, events, starved jobs, webhooks stream, then the feed keys (as
# JOB_CREATE). ARGV: id, token, wire version, the workers' consumer group, then per answer:
# index, ok (1/0), reply message. The first answer of an index is kept (HSETNX) and only it
# counts, so a redelivered item is recorded once. Then the job is completed, or fed as many new
# items as were answered and its level and quota let in (keys that are not the job's: none, and
# it is left to the workers' pump). Returns the answers recorded. allow-oom like FINISH (below):
# a worker at maxmemory must still record what it ran.
JOB_RECORD = "#!lua flags=allow-oom\n" + _JOB_HELPERS + """
local job, results, inputs, log, events, starved = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local f = redis.call('HMGET', job, 'state', 'total', 'expires', 'ttl')
if f[1] ~= 'queued' and f[1] ~= 'running' then return 0 end
local total = tonumber(f[2])
local ok, failed, indexes = 0, 0, {}
for a = 5, #ARGV, 3 do
  local i = tonumber(ARGV[a])
  if i and i == math.floor(i) and i >= 0 and i < total and redis.call('HSETNX', results, ARGV[a], ARGV[a + 2]) == 1 then
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
if not complete(job, log, events, KEYS[7], ARGV[1]) and
   feed(job, inputs, starved, 8, ARGV[1], ARGV[2], ARGV[3], ARGV[4]) < 0 then
  redis.call('ZADD', starved, 0, ARGV[1])
  extend(starved, f[4])
end
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

# KEYS[1] dead-letter stream, KEYS[2..1+s] the request streams (priority levels) that entries
# are acked on, then r reply lists, then the r cancellation sets of their tokens (keys.cancelled).
# ARGV: group, s, number of dead letters, dead-letter max length, dead-letter max bytes, then per
# request stream the number of ids to ack on it; then per reply list its TTL in ms, its number of
# messages and the messages; then per dead letter its field count followed by its fields and
# values; then the ids to ack and delete, stream by stream.
# Replies, dead letters, XACK and XDEL in one script: no reply without its ack or the reverse. A
# reply list whose token was withdrawn whole while the batch ran ('*' in its cancellation set)
# gets nothing: its caller is gone.
FINISH = """#!lua flags=allow-oom""" + _CHECKS + """
local group = ARGV[1]
local streams = integer(ARGV[2], 0, #KEYS - 1, 'number of request streams')
local letters = integer(ARGV[3], 0, #ARGV, 'number of dead letters')
local dead_len = integer(ARGV[4], 0, 2 ^ 53, 'dead-letter max length')
local dead_bytes = integer(ARGV[5], 0, 2 ^ 53, 'dead-letter max bytes')
local replies = integer((#KEYS - 1 - streams) / 2, 0, #KEYS, 'number of reply lists')
-- Every count and TTL first: a reply is never pushed for a batch whose ack would then fail.
local a = 6 + streams
for _ = 1, replies do
  integer(ARGV[a], 1, MAX_MS, 'reply TTL (ms)')
  a = a + 2 + integer(ARGV[a + 1], 0, #ARGV, 'number of reply messages')
end
for _ = 1, letters do a = a + 1 + integer(ARGV[a], 0, #ARGV, 'number of dead-letter fields') end
for s = 1, streams do a = a + integer(ARGV[5 + s], 0, #ARGV, 'number of acks') end
integer(a - 1, 0, #ARGV, 'number of arguments')
a = 6 + streams
for k = 2 + streams, 1 + streams + replies do
  local ttl, n = ARGV[a], tonumber(ARGV[a + 1])
  if redis.call('SISMEMBER', KEYS[k + replies], '*') == 0 then
    redis.call('RPUSH', KEYS[k], unpack(ARGV, a + 2, a + 1 + n))
    redis.call('PEXPIRE', KEYS[k], ttl)
  end
  a = a + 2 + n
end
for _ = 1, letters do
  local n = tonumber(ARGV[a])
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
for s = 1, streams do
  local acks = tonumber(ARGV[5 + s])
  while acks > 0 do
    local n = math.min(acks, 1000)
    redis.call('XACK', KEYS[1 + s], group, unpack(ARGV, a, a + n - 1))
    redis.call('XDEL', KEYS[1 + s], unpack(ARGV, a, a + n - 1))
    a, acks = a + n, acks - n
  end
end
return 1
"""

# KEYS[1] the token's cancellation set (keys.cancelled), KEYS[2] the request stream of the
# call's priority level, KEYS[3..5] its held-item queue, held items and clocks. ARGV: group,
# the set's TTL in ms, whole (1: no other call shares the token, so its replies may be dropped
# whole), n, then n entry ids, then their n indexes.
# Withdraws a caller's items (rstreamer.cancel): an entry not yet delivered to a worker is deleted
# (XDEL: no worker will ever read it); one a worker holds is marked in the set, which the worker
# checks before predict (and FINISH, with '*', before replying). One script, so an entry is
# either deleted before any worker reads it or marked: never both, never neither. A held item (id
# 'token:index', fair sharing) still held is deleted, and its tenant's turns do not count it
# (withdraw); one already moved to the stream is marked (its stream id is not known here), so a
# worker that reads it skips it.
# Returns {entries deleted, then the indexes of the entries marked (held by a worker)}.
CANCEL = _FAIR_HELPERS + """
local group, whole = ARGV[1], ARGV[3]
local ttl = integer(ARGV[2], 1, MAX_MS, 'cancellation TTL (ms)')
local n = integer(ARGV[4], 0, (#ARGV - 4) / 2, 'number of entries')
local reply = {0}
local withdrawn = {}
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
    reply[1] = reply[1] + redis.call('XDEL', KEYS[2], id)
  end
end
-- Latest first, so that a withdrawn call at the tail of its tenant's items gives back all its turns.
table.sort(withdrawn, function(x, y) return x[1] > y[1] end)
for _, item in ipairs(withdrawn) do withdraw(KEYS[5], item[2], item[1]) end
if #reply > 1 then
  if whole == '1' then redis.call('SADD', KEYS[1], '*') end
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return reply
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

# KEYS: per priority level 0, 1, ... its request stream, held-item queue, held items and virtual
# clocks (rstreamer.levelsource.LevelSource). ARGV: group, consumer, max_items, fair (1: promote
# held items, see _FAIR_HELPERS), then per level its guaranteed quota (priority.DeficitScheduler).
# One read of up to max_items entries in two passes: each level takes up to its quota, most
# urgent first; then what is left goes to the most urgent levels that still have entries. Reads
# with XREADGROUP '>' (new deliveries, id order: FIFO within a level; with fair sharing, each
# read first moves as many held items as it asks for onto the stream, fairest first). Returns per
# level {taken in the first pass, taken in the second, 1 if a read of it came back short (it has
# no more), newest entry id ('0-0' for none), entries {id, {field, value, ...}}...}; a blocked
# XREAD waits for an entry newer than those ids when nothing was read (no entry is missed between
# the two). allow-oom: reading is how a full Redis drains.
READ_LEVELS = "#!lua flags=allow-oom\n" + _FAIR_HELPERS + """
local group, consumer, left, fair = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4] == '1'
local levels = #KEYS / 4
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local out = {}
for l = 1, levels do out[l] = {0, 0, 0, '0-0'} end
local function take(l, count, pass)
  local stream = KEYS[4 * l - 3]
  if fair then promote(stream, KEYS[4 * l - 2], KEYS[4 * l - 1], KEYS[4 * l], count, now_ms) end
  local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', count, 'STREAMS', stream, '>')
  local entries = (reply and reply[1] and reply[1][2]) or {}
  for _, entry in ipairs(entries) do out[l][#out[l] + 1] = entry end
  out[l][pass] = out[l][pass] + #entries
  if #entries < count then out[l][3] = 1 end
  left = left - #entries
end
for l = 1, levels do
  local quota = math.min(tonumber(ARGV[4 + l]), left)
  if quota > 0 then take(l, quota, 1) end
end
for l = 1, levels do
  if left > 0 and out[l][3] == 0 then take(l, left, 2) end
end
if left == tonumber(ARGV[3]) then
  for l = 1, levels do
    local newest = redis.call('XREVRANGE', KEYS[4 * l - 3], '+', '-', 'COUNT', 1)
    if newest[1] then out[l][4] = newest[1][1] end
  end
end
return out
"""

# KEYS: per priority level 0, 1, ... its request stream, held-item queue, held items and virtual
# clocks (as READ_LEVELS). ARGV: group.
# The server's time and, per level, {length, pending, ms of the oldest undelivered entry (-1 for
# none), held items} in one script: one slot, one clock (the entry ids' and TIME's), so the waits
# it gives agree with what the workers see (rstreamer status, the dashboard). Held items (fair
# sharing) count in the length; their wait is that of the item next in line.
QUEUE_DEPTHS = _FAIR_HELPERS + """
local now = redis.call('TIME')
local out = {now[1], now[2]}
for l = 1, #KEYS / 4 do
  local stream = KEYS[4 * l - 3]
  local length, pending, oldest = 0, 0, -1
  if redis.call('EXISTS', stream) == 1 then
    length = redis.call('XLEN', stream)
    local first = '-'
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
      local info = {}
      for k = 1, #g, 2 do info[g[k]] = g[k + 1] end
      if info['name'] == ARGV[1] then
        pending = info['pending']
        first = '(' .. info['last-delivered-id']
      end
    end
    if length > pending then
      local head = redis.call('XRANGE', stream, first, '+', 'COUNT', 1)
      if head[1] then oldest = tonumber(string.match(head[1][1], '^(%d+)')) end
    end
  end
  local held = redis.call('ZCARD', KEYS[4 * l - 2])
  local since = held_since(KEYS[4 * l - 2], KEYS[4 * l - 1])
  if since and (oldest < 0 or since < oldest) then oldest = since end
  out[#out + 1] = {length + held, pending, oldest, held}
end
return out
"""
