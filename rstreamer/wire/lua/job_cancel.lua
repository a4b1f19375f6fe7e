-- KEYS: job, inputs, log, events, webhooks stream. ARGV: id. Returns 1 cancelled, 0 already
-- finished, -1 unknown.
-- The items not fed yet are dropped; the workers skip those already fed (JOB_ADMIT).
--- @include "include/job.lua"
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
