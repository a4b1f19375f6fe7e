#!lua flags=allow-oom
-- KEYS[1] workers hash. ARGV: consumer name, JSON info, key TTL in ms.
-- The server's clock stamps the beat, so liveness never depends on clocks agreeing. allow-oom
-- (see FINISH below): a worker at maxmemory must not look dead and be robbed.
--- @include "include/checks.lua"
local ttl = integer(ARGV[3], 1, MAX_MS, 'heartbeat TTL (ms)')
local info = cjson.decode(ARGV[2])
info['seen_ms'] = server_ms()
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(info))
redis.call('PEXPIRE', KEYS[1], ttl)
return info['seen_ms']
