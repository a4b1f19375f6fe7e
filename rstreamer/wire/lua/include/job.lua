-- Durable jobs (rstreamer.jobs.sync, rstreamer.jobs.sink). A job is a hash (state, total, done,
-- failed, fed, window, level, created, expires, ttl, meta), a list of the encoded items not fed
-- yet, a hash of answers by index and a log stream of the indexes answered, in order. The
-- scripts below share these helpers (concatenated in front of each): feeding, completion and
-- events are each one atomic step, so any process may run them and none needs a lease.
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
-- A job with a webhook: one delivery for the workers' webhook senders (rstreamer.jobs.webhooks).
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
