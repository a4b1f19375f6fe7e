-- Admission and enqueue of the calls one client sends under one token (messages.enqueue_args
-- builds the arguments, messages.Admission reads the reply). KEYS[1] the levels the workers
-- published (JSON {weights, max_queue}; absent: one level, as before priority levels), KEYS[2]
-- the tenant quotas they published (JSON {rate, burst, tenants}; absent: no quotas), KEYS[3..2+t]
-- the token buckets of the t tenants the calls name, then per level 0, 1, ... up to the highest
-- level among the calls its request stream, held-item queue, held items and virtual clocks (see
-- include/fair.lua; used when the levels say 'fair').
-- ARGV: max_queue (items, 0 = no limit), max_queue_bytes (0 = no limit), admit_wait_permille,
-- group, token, wire version, number of calls n, number of tenants t, then the t tenant names,
-- then n quintuples (item count, remaining timeout in ms, deadline on the client's wall clock in
-- ms, priority level, tenant number 1..t or 0 for none), then the payloads of every call in
-- order, then optionally one W3C traceparent per call ('' = none).
-- Each call is checked as if it came alone, one after another, and added or refused on its own
-- (a bulk call refused never refuses an urgent call coalesced after it). The reply is {n, then
-- per call its reason, detail and limit, then the ids of the entries added, in order (a caller
-- withdraws them when it cancels)} with reason 0 added, 1 the undelivered backlog of the call's
-- level and of the more urgent ones, plus the call's items, would exceed the level's bound
-- (detail: the backlog in items; limit: the bound: the level's published max_queue, else the
-- client's), 2 the streams' memory would exceed max_queue_bytes (detail: bytes), 3 the oldest
-- undelivered entry of the call's level has waited more than admit_wait_permille/1000 of the
-- call's remaining timeout, so that a new item would not run in time (detail: its age in ms, on
-- the server's clock like every entry id), 4 the level is beyond the levels the workers serve
-- (detail: their number of levels), 5 the tenant is over its quota (detail: ms until its bucket
-- holds enough tokens, -1 when the call is larger than the burst; limit: the burst). Items are
-- numbered across the calls, refused ones included (each call's answers go to its own offset).
-- Counting the more urgent levels' backlog is what makes Overloaded hit the least urgent level
-- first. A token bucket (tokens, ms of the last refill) refills at rate items/s
-- up to burst; a call takes one token per item, only once every other check has passed. Check
-- and add are one script, so concurrent callers cannot overshoot. With fair sharing the items
-- are held (their ids are then 'token:index') and the backlog counts held items too.
--- @include "include/fair.lua"
local max_queue, max_bytes = tonumber(ARGV[1]), tonumber(ARGV[2])
local permille, group, token, version = tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local calls, tenants = tonumber(ARGV[7]), tonumber(ARGV[8])
local streams = (#KEYS - 2 - tenants) / 4
local function level_key(l, k) return KEYS[2 + tenants + 4 * (l - 1) + k] end
local levels, bounds, fair = 1, {}, false
local published = redis.call('GET', KEYS[1])
if published then
  local config = cjson.decode(published)
  levels = #config['weights']
  bounds = config['max_queue'] or {}
  fair = config['fair'] == true
end
local quotas = nil
local published_quotas = redis.call('GET', KEYS[2])
if published_quotas then quotas = cjson.decode(published_quotas) end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local backlog, undelivered, age, queued_bytes = {}, {}, {}, 0
for l = 1, streams do
  local stream = level_key(l, 1)
  backlog[l], age[l] = 0, 0
  if redis.call('EXISTS', stream) == 1 then
    backlog[l] = redis.call('XLEN', stream)
    local first = '-'
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
      local info = {}
      for k = 1, #g, 2 do info[g[k]] = g[k + 1] end
      if info['name'] == group then
        backlog[l] = backlog[l] - info['pending']
        first = '(' .. info['last-delivered-id']
      end
    end
    if backlog[l] > 0 then
      local head = redis.call('XRANGE', stream, first, '+', 'COUNT', 1)
      if head[1] then age[l] = math.max(0, now_ms - tonumber(string.match(head[1][1], '^(%d+)'))) end
    end
    if max_bytes > 0 then queued_bytes = queued_bytes + redis.call('MEMORY', 'USAGE', stream, 'SAMPLES', 0) end
  end
  undelivered[l] = backlog[l]
  if fair then
    backlog[l] = backlog[l] + redis.call('ZCARD', level_key(l, 2))
    local since = held_since(level_key(l, 2), level_key(l, 3))
    if since then age[l] = math.max(age[l], now_ms - since) end
    if max_bytes > 0 and since then
      queued_bytes = queued_bytes + redis.call('MEMORY', 'USAGE', level_key(l, 3), 'SAMPLES', 0)
    end
  end
end
-- A full fair level still admits a tenant holding less than an equal share of the bound (the
-- tenants holding items, itself included), up to twice the bound: a tenant that filled the level
-- does not shut the others out.
local function under_share(l, tenant, size, ahead, limit)
  local own, waiting = holding(level_key(l, 4), tenant > 0 and ARGV[8 + tenant] or '')
  if own == 0 then waiting = waiting + 1 end
  return own + size <= limit / math.max(1, waiting) and ahead + size <= 2 * limit
end
-- tenant number -> {rate, burst, tokens} (tokens refilled to now), read once per script
local buckets = {}
local function bucket(number)
  if buckets[number] then return buckets[number] end
  local name = ARGV[8 + number]
  local rate, burst = 0, 0
  if quotas then
    local own = quotas['tenants'] and quotas['tenants'][name]
    if own then rate, burst = tonumber(own[1]), tonumber(own[2])
    else rate, burst = tonumber(quotas['rate']), tonumber(quotas['burst']) end
  end
  local b = {rate = rate, burst = burst, tokens = burst}
  if rate > 0 then
    local state = redis.call('HMGET', KEYS[2 + number], 'tokens', 'ms')
    if state[1] then
      local elapsed = math.max(0, now_ms - tonumber(state[2]))
      b.tokens = math.min(burst, tonumber(state[1]) + elapsed * rate / 1000)
    end
  end
  buckets[number] = b
  return b
end
local payload = 9 + tenants + 5 * calls
local traced = payload
for c = 1, calls do traced = traced + tonumber(ARGV[4 + tenants + 5 * c]) end
local index = 0
local reply, ids = {calls}, {}
for c = 1, calls do
  local at = 4 + tenants + 5 * c
  local size, remaining, deadline = tonumber(ARGV[at]), ARGV[at + 1], ARGV[at + 2]
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
    limit = tonumber(bounds[level + 1] or 0)
    if limit <= 0 then limit = max_queue end
    local ahead = 0
    for l = 1, level + 1 do ahead = ahead + backlog[l] end
    if limit > 0 and ahead + size > limit and not (fair and under_share(level + 1, tenant, size, ahead, limit)) then
      reason, detail = 1, ahead
    elseif max_bytes > 0 and queued_bytes + bytes > max_bytes then reason, detail, limit = 2, queued_bytes, max_bytes
    elseif age[level + 1] * 1000 > permille * tonumber(remaining) then reason, detail, limit = 3, age[level + 1], 0
    else limit = 0 end
  end
  if reason == 0 then
    if b then
      b.tokens = b.tokens - size
      redis.call('HSET', KEYS[2 + tenant], 'tokens', tostring(b.tokens), 'ms', now_ms)
      redis.call('PEXPIRE', KEYS[2 + tenant], math.ceil(b.burst * 1000 / b.rate) + 1000)
    end
    local stream = level_key(level + 1, 1)
    local function fields_of(k)
      local fields = {'v', version, 't', token, 'i', index + k, 'r', remaining, 'd', deadline, 'p', ARGV[payload + k]}
      if tp and tp ~= '' then fields[13], fields[14] = 'tp', tp end
      return fields
    end
    if fair then
      local queue, items, clock = level_key(level + 1, 2), level_key(level + 1, 3), level_key(level + 1, 4)
      hold(queue, items, clock, tenant > 0 and ARGV[8 + tenant] or '', token, index, fields_of, size, now_ms,
           tonumber(remaining) + 60000)
      for k = 0, size - 1 do ids[#ids + 1] = token .. ':' .. (index + k) end
      if undelivered[level + 1] == 0 then
        undelivered[level + 1] = promote(stream, queue, items, clock, 1, now_ms)
      end
    else
      for k = 0, size - 1 do ids[#ids + 1] = redis.call('XADD', stream, '*', unpack(fields_of(k))) end
    end
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
