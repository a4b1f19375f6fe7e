-- KEYS[1] the shelf workers' heartbeats hash, KEYS[2] the holders hash, KEYS[3] the stats hash.
-- Returns {seconds, microseconds, {heartbeat field, value, ...}, {holders ...}, {stats ...}}: the
-- fleet's state on the clock that stamped its heartbeats, in one round trip (the three keys share
-- the shelf's hash tag, so this works on Redis Cluster too).
local now = redis.call('TIME')
return {now[1], now[2], redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2]),
        redis.call('HGETALL', KEYS[3])}
