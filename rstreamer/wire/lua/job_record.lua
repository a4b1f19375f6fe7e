#!lua flags=allow-oom
-- KEYS: job, results, inputs, log, events, starved jobs, webhooks stream, then the feed keys (as
-- JOB_CREATE). ARGV: id, token, wire version, the workers' consumer group, then per answer:
-- index, ok (1/0), reply message. The first answer of an index is kept (HSETNX) and only it
-- counts, so a redelivered item is recorded once. Then the job is completed, or fed as many new
-- items as were answered and its level and quota let in (keys that are not the job's: none, and
-- it is left to the workers' pump). Returns the answers recorded. allow-oom like FINISH (below):
-- a worker at maxmemory must still record what it ran.
--- @include "include/job.lua"
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
