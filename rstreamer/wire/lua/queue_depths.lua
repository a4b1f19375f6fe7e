-- KEYS: per priority level 0, 1, ... its request stream, held-item queue, held items and virtual
-- clocks (as READ_LEVELS). ARGV: group.
-- The server's time and, per level, {length, pending, ms of the oldest undelivered entry (-1 for
-- none), held items} in one script: one slot, one clock (the entry ids' and TIME's), so the waits
-- it gives agree with what the workers see (rstreamer status, the dashboard). Held items (fair
-- sharing) count in the length; their wait is that of the item next in line.
--- @include "include/fair.lua"
local now = redis.call('TIME')
local out = {now[1], now[2]}
for l = 1, #KEYS / 4 do
  local stream = KEYS[4 * l - 3]
  local length, pending, oldest = 0, 0, -1
  if redis.call('EXISTS', stream) == 1 then
    length = redis.call('XLEN', stream)
    local first = '-'
    local info = group_info(stream, ARGV[1])
    if info then
      pending = info['pending']
      first = '(' .. info['last-delivered-id']
    end
    if length > pending then
      local head = redis.call('XRANGE', stream, first, '+', 'COUNT', 1)
      if head[1] then oldest = tonumber(string.match(head[1][1], '^(%d+)')) end
    end
  end
  local held = redis.call('ZCARD', KEYS[4 * l - 2])
  local since = held_since(KEYS[4 * l - 2], KEYS[4 * l - 1])
  if since and (oldest < 0 or since < oldest) then oldest = since end
  out[#out + 1] = {length + held, pending, oldest, held}
end
return out
