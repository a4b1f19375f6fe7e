-- KEYS: job, inputs, jobs index, log, events, request stream, webhooks stream. ARGV: id, token,
-- wire version, total, ttl ms, window, level ('' = least urgent), meta (JSON), webhook URL ('').
-- The inputs were uploaded before (with the TTL). Returns 1, -1 when the id exists, -2 when
-- the inputs are incomplete.
--- @include "include/job.lua"
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
