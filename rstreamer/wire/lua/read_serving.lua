-- KEYS[1] a prefix's workers hash, KEYS[2] the prefix's shelf marker.
-- Returns {seconds, microseconds, {field, value, ...}, shelf name or false}: the heartbeats as
-- READ_WORKERS gives them, and the shelf whose workers can load the prefix's model (one slot: the
-- keys share the prefix's hash tag).
local now = redis.call('TIME')
return {now[1], now[2], redis.call('HGETALL', KEYS[1]), redis.call('GET', KEYS[2])}
