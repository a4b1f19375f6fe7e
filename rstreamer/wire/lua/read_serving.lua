-- KEYS[1] a prefix's workers hash, KEYS[2] the prefix's shelf marker, KEYS[3] its published levels.
-- Returns {seconds, microseconds, {field, value, ...}, shelf name or false, levels or false}: the
-- heartbeats as READ_WORKERS gives them, the shelf whose workers can load the prefix's model, and
-- the levels the workers published, read together (one slot: the keys share the prefix's hash
-- tag), so that a reading that sees a worker sees the levels it published before its first beat.
local now = redis.call('TIME')
return {now[1], now[2], redis.call('HGETALL', KEYS[1]), redis.call('GET', KEYS[2]), redis.call('GET', KEYS[3])}
