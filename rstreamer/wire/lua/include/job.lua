--- @include "include/admission.lua"
-- Durable jobs (rstreamer.jobs.sync, rstreamer.jobs.sink). A job is a hash (state, total, done,
-- failed, fed, window, level, tenant, max_queue, created, expires, ttl, meta), a list of the
-- encoded items not fed yet, a hash of answers by index and a log stream of the indexes
-- answered, in order. The job scripts share these helpers (each includes them):
-- feeding, completion and events are each one atomic step, so any process may run them and none
-- needs a lease. A job's items are fed by the admission rules of a call (include/admission.lua).
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
    backlog, undelivered = level_queue(level_keys(at + 2, l), group, fair, false, function() return now end)
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
