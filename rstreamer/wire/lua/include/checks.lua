-- Checks every script makes before it writes anything (issue 22). A Lua error does not roll back
-- the writes made before it, so a script that failed half-way left half a state (a job hash
-- without a TTL, an item held for a call its caller was told was refused). And Lua hands a number
-- to a Redis command in the shortest form that reads back the same, "1e+17" from 1e17 on, which
-- PEXPIRE and XADD's ids refuse: a script must never compute such a number. So every duration a
-- script takes is an integer number of ms up to MAX_MS, checked first, and what it computes from
-- them (the server's ms plus a duration, about 1.8e12) stays a plain integer.
-- The longest duration (ms) any script accepts: 366 days (wire.messages.MAX_DURATION_MS). The
-- clients and web apps refuse much less (settings.MAX_TIMEOUT, settings.MAX_JOB_TTL).
local MAX_MS = 31622400000
-- value as an integer from low to high; otherwise the script stops with an error, before it writes.
-- (n % 1: math.floor is a call into C, about 300 instructions; it also refuses an infinity.)
local function integer(value, low, high, what)
  local n = tonumber(value)
  if not n or n % 1 ~= 0 or n < low or n > high then
    error(redis.error_reply('ERR rstreamer: invalid ' .. what .. ': ' .. string.sub(tostring(value), 1, 40)))
  end
  return n
end
-- integer() for checks run under pcall: value + 0 reads a string as tonumber() would, once and
-- without a call into C (tonumber() reads it twice: a '0' costs 300 instructions instead of
-- 1,000; callgrind, Redis 7.0, issue 26), and stops with an error that names nothing when value
-- is no number. Run the checks again with integer() to name the value.
local function quick_integer(value, low, high)
  local n = value + 0
  if n % 1 ~= 0 or n < low or n > high then error('not an integer in range') end
  return n
end
-- The server's time in ms.
local function server_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- The server's time in ms, read at most once, and only when asked for: a script that needs no
-- clock (a lone call's admission on an empty queue, issue 26) runs no TIME.
local function lazy_clock()
  local ms = nil
  return function()
    ms = ms or server_ms()
    return ms
  end
end
