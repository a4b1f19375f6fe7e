#!lua flags=allow-oom
-- KEYS[1] a model's load lease. ARGV[1] this worker.
-- Gives the lease back only if this worker has it (a lease taken over from a worker that looked
-- dead stays with its new owner). Returns 1 when deleted.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
