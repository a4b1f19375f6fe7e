#!lua flags=allow-oom
-- KEYS[1] workers hash. ARGV: consumer name, JSON info, key TTL in ms.
-- The server's clock stamps the beat, so liveness never depends on clocks agreeing. allow-oom
-- (see FINISH below): a worker at maxmemory must not look dead and be robbed.
local now = redis.call('TIME')
local info = cjson.decode(ARGV[2])
info['seen_ms'] = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(info))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return info['seen_ms']
