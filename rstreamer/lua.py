"""Every Lua script rstreamer runs, in one place."""
from __future__ import annotations

# KEYS[1] request stream. ARGV: max_queue (0 = no limit), group, token, deadline_ms, payload...
# Returns the number of items added, or -1 when the undelivered backlog is at max_queue.
# Check and add happen in one script so that concurrent callers cannot overshoot the limit.
ENQUEUE = """
local max_queue = tonumber(ARGV[1])
if max_queue > 0 then
  local backlog = redis.call('XLEN', KEYS[1])
  local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[2])
  if ok then backlog = backlog - pending[1] end
  if backlog >= max_queue then return -1 end
end
for i = 5, #ARGV do
  redis.call('XADD', KEYS[1], '*', 't', ARGV[3], 'i', i - 5, 'd', ARGV[4], 'p', ARGV[i])
end
return #ARGV - 4
"""

# ENQUEUE for several calls coalesced by one client under one token. KEYS[1] request stream.
# ARGV: max_queue (0 = no limit), group, token, number of calls n, then n pairs (item count,
# deadline_ms), then the payloads of every call in order. Each call is checked as ENQUEUE
# would check it alone, one after another: once the undelivered backlog is at max_queue, that
# call and the ones after it are refused. Items are numbered across the calls. Returns the
# number of calls accepted (the first ones).
ENQUEUE_CALLS = """
local max_queue = tonumber(ARGV[1])
local calls = tonumber(ARGV[4])
local backlog = 0
if max_queue > 0 then
  backlog = redis.call('XLEN', KEYS[1])
  local ok, pending = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[2])
  if ok then backlog = backlog - pending[1] end
end
local payload = 5 + 2 * calls
local index = 0
for c = 1, calls do
  if max_queue > 0 and backlog >= max_queue then return c - 1 end
  local size = tonumber(ARGV[3 + 2 * c])
  local deadline = ARGV[4 + 2 * c]
  for _ = 1, size do
    redis.call('XADD', KEYS[1], '*', 't', ARGV[3], 'i', index, 'd', deadline, 'p', ARGV[payload])
    index = index + 1
    payload = payload + 1
  end
  backlog = backlog + size
end
return calls
"""

# KEYS[1] workers hash. ARGV: consumer name, JSON info, key TTL in ms.
# The server's clock stamps the beat, so liveness never depends on clocks agreeing.
HEARTBEAT = """
local now = redis.call('TIME')
local info = cjson.decode(ARGV[2])
info['seen_ms'] = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(info))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return info['seen_ms']
"""

# KEYS[1] workers hash. Returns {seconds, microseconds, {field, value, ...}}.
# TIME and HGETALL in one script: the clock read is that of the server that stamped the beats,
# which on Redis Cluster a keyless TIME in a pipeline could not promise.
READ_WORKERS = """
local now = redis.call('TIME')
return {now[1], now[2], redis.call('HGETALL', KEYS[1])}
"""
