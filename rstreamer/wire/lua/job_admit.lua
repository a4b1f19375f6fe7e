#!lua flags=allow-oom
-- KEYS: job hashes. Returns, per job, {state, level, tenant} ('' for a job that no longer
-- exists); a queued job becomes running. Run by a worker before it predicts: items of a job
-- that was cancelled, expired or purged are not run.
--- @include "include/job.lua"
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
