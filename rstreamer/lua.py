"""Every Lua script rstreamer runs, in one place."""
from __future__ import annotations

# Admission and enqueue of the calls one client sends under one token (messages.enqueue_args
# builds the arguments, messages.Admission reads the reply). KEYS[1] request stream.
# ARGV: max_queue (items, 0 = no limit), max_queue_bytes (0 = no limit), admit_wait_permille,
# group, token, wire version, number of calls n, then n triples (item count, remaining timeout
# in ms, deadline on the client's wall clock in ms), then the payloads of every call in order.
# Each call is checked as if it came alone, one after another; the first one refused and the
# ones after it are not added, and the reply says why: {accepted, reason, detail} with reason
# 0 none, 1 undelivered backlog at max_queue (detail: items), 2 the stream's memory would exceed
# max_queue_bytes (detail: bytes), 3 the oldest undelivered entry has waited more than
# admit_wait_permille/1000 of the call's remaining timeout, so that a new item would not run in
# time (detail: its age in ms, on the server's clock like every entry id). Items are numbered
# across the calls. Check and add are one script, so concurrent callers cannot overshoot.
ENQUEUE_CALLS = """
local max_queue, max_bytes = tonumber(ARGV[1]), tonumber(ARGV[2])
local permille, group, token, version = tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]
local calls = tonumber(ARGV[7])
local backlog, queued_bytes, oldest_ms = 0, 0, nil
if redis.call('EXISTS', KEYS[1]) == 1 then
  backlog = redis.call('XLEN', KEYS[1])
  local first = '-'
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local info = {}
    for k = 1, #g, 2 do info[g[k]] = g[k + 1] end
    if info['name'] == group then
      backlog = backlog - info['pending']
      first = '(' .. info['last-delivered-id']
    end
  end
  if backlog > 0 then
    local head = redis.call('XRANGE', KEYS[1], first, '+', 'COUNT', 1)
    if head[1] then oldest_ms = tonumber(string.match(head[1][1], '^(%d+)')) end
  end
  if max_bytes > 0 then queued_bytes = redis.call('MEMORY', 'USAGE', KEYS[1], 'SAMPLES', 0) end
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local age = 0
if oldest_ms then age = math.max(0, now_ms - oldest_ms) end
local payload = 8 + 3 * calls
local traced = payload  -- optional: one W3C traceparent per call after the payloads ('' = none)
for c = 1, calls do traced = traced + tonumber(ARGV[5 + 3 * c]) end
local index = 0
for c = 1, calls do
  local size, remaining, deadline = tonumber(ARGV[5 + 3 * c]), ARGV[6 + 3 * c], ARGV[7 + 3 * c]
  local tp = ARGV[traced + c - 1]
  local bytes = 0
  for k = payload, payload + size - 1 do bytes = bytes + #ARGV[k] end
  if max_queue > 0 and backlog >= max_queue then return {c - 1, 1, backlog} end
  if max_bytes > 0 and queued_bytes + bytes > max_bytes then return {c - 1, 2, queued_bytes} end
  if age * 1000 > permille * tonumber(remaining) then return {c - 1, 3, age} end
  for _ = 1, size do
    if tp and tp ~= '' then
      redis.call('XADD', KEYS[1], '*', 'v', version, 't', token, 'i', index, 'r', remaining,
                 'd', deadline, 'p', ARGV[payload], 'tp', tp)
    else
      redis.call('XADD', KEYS[1], '*', 'v', version, 't', token, 'i', index, 'r', remaining,
                 'd', deadline, 'p', ARGV[payload])
    end
    index = index + 1
    payload = payload + 1
  end
  backlog = backlog + size
  queued_bytes = queued_bytes + bytes
end
return {calls, 0, 0}
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
