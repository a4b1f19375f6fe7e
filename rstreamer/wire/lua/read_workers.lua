-- KEYS[1] workers hash. Returns {seconds, microseconds, {field, value, ...}}.
-- TIME and HGETALL in one script: the clock read is that of the server that stamped the beats,
-- which on Redis Cluster a keyless TIME in a pipeline could not promise.
local now = redis.call('TIME')
return {now[1], now[2], redis.call('HGETALL', KEYS[1])}
