-- KEYS: job, inputs, jobs index, log, events, starved jobs, webhooks stream, then the feed keys
-- (Keys.job_feed: the published levels and quotas, the keys of levels 0 to the job's,
-- its tenant's bucket if it has one). ARGV: id, token, wire version, total, ttl ms, window, level,
-- meta (JSON), webhook URL (''), tenant ('' = none), max_queue (the submitter's bound, 0 = none),
-- the workers' consumer group. Every number is checked before anything is written.
-- The inputs were uploaded before (with the TTL). Returns 1, -1 when the id exists, -2 when
-- the inputs are incomplete.
--- @include "include/job.lua"
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
