-- Admission and enqueue of the calls one client sends under one token (messages.enqueue_args
-- builds the arguments, messages.Admission reads the reply). KEYS[1] the levels the workers
-- published (JSON {weights, max_queue}; absent: one level, as before priority levels), KEYS[2]
-- the tenant quotas they published (JSON {rate, burst, tenants}; absent: no quotas), KEYS[3..2+t]
-- the token buckets of the t tenants the calls name, then per level 0, 1, ... up to the highest
-- level among the calls its request stream, held-item queue, held items and virtual clocks (see
-- include/fair.lua; used when the levels say 'fair').
-- ARGV: max_queue (items, 0 = no limit), max_queue_bytes (0 = no limit), admit_wait_permille,
-- group, token, wire version, number of calls n, number of tenants t, the client's copy of the
-- published levels ('?': none, read KEYS[1]; '': nothing published; else its JSON), then the t
-- tenant names,
-- then n quintuples (item count, remaining timeout in ms, deadline on the client's wall clock in
-- ms, priority level, tenant number 1..t or 0 for none), then the payloads of every call in
-- order, then optionally one W3C traceparent per call ('' = none). Every number is checked
-- before anything is written (a remaining timeout up to MAX_MS).
-- Each call is checked as if it came alone, one after another, and added or refused on its own
-- (a bulk call refused never refuses an urgent call coalesced after it). The reply is {n, then
-- per call its reason, detail and limit, then the ids of the entries added, in order (a caller
-- withdraws them when it cancels)} with reason 0 added, 1 the undelivered backlog of the call's
-- level and of the more urgent ones, plus the call's items, would exceed the level's bound
-- (detail: the backlog in items; limit: the bound: the level's published max_queue, else the
-- client's), 2 the streams' memory would exceed max_queue_bytes (detail: bytes), 3 the oldest
-- undelivered entry of the call's level has waited more than admit_wait_permille/1000 of the
-- call's remaining timeout, so that a new item would not run in time (detail: its age in ms, on
-- the server's clock like every entry id), 4 the level is beyond the levels the workers serve
-- (detail: their number of levels), 5 the tenant is over its quota (detail: ms until its bucket
-- holds enough tokens, -1 when the call is larger than the burst; limit: the burst). Items are
-- numbered across the calls, refused ones included (each call's answers go to its own offset).
-- Counting the more urgent levels' backlog is what makes Overloaded hit the least urgent level
-- first. A call takes one token per item of its tenant's bucket, only once every other check
-- has passed. Check and add are one script, so concurrent callers cannot overshoot. With fair
-- sharing the items are held (their ids are then 'token:index'; a single item for a level that
-- holds none and has nothing undelivered goes onto the stream at once, see add) and the backlog
-- counts held items too.
--- @include "include/admission.lua"
local ARGV = ARGV  -- a local, not a global: read about ten times per call
local group, token, version = ARGV[4], ARGV[5], ARGV[6]
-- Every number first: a call refused by these checks must not follow calls added. Each is
-- converted once and checked inline, a call's remaining timeout kept in `remaining_of`: five
-- calls of integer() per call took a sixth of an ENQUEUE of 16 calls (issue 26). The remaining
-- timeout and the deadline also stay the strings they came as, for the entries: Redis formats a
-- number handed to redis.call with printf's float code, a twentieth of an ENQUEUE of 16 calls
-- (callgrind; issue 26). A worker reads the remaining timeout as a plain integer and fails an
-- item whose entry has another form. The slow path below repeats the ranges with integer()'s
-- names; the numbers before the calls are inline too (through quick_integer, as FINISH does it,
-- a lone ENQUEUE took 3 % more instructions).
-- A string takes part in arithmetic as the number tonumber() would give, read once and without
-- a function call, where tonumber() reads it twice (lua_isnumber, then lua_tonumber: strtod
-- twice): a deadline's 13 digits cost 600 instructions instead of 1,900, and an ENQUEUE of 16
-- calls 7 % fewer (callgrind, Redis 7.0; issue 26). A string that is no number stops it with an
-- error instead of nil, so read_numbers runs under pcall, and a failure is named below. What it
-- reads comes as arguments: a closure over the script's locals costs an upvalue object each.
-- Returns max_queue, max_bytes, permille, the number of calls and of tenants, the last
-- payload's place and the highest level of the calls.
local function read_numbers(argv, count, nkeys, remaining_of, max_ms)
  local max_queue, max_bytes, permille, calls, tenants = argv[1] + 0, argv[2] + 0, argv[3] + 0, argv[7] + 0, argv[8] + 0
  if not (max_queue % 1 == 0 and max_bytes % 1 == 0 and permille % 1 == 0 and calls % 1 == 0 and tenants % 1 == 0
          and max_queue >= 0 and max_bytes >= 0 and permille >= 0 and permille <= 1000 and calls >= 0
          and calls <= count and tenants >= 0 and tenants <= nkeys) then
    error('a number out of range')  -- named below
  end
  local last, top = 9 + tenants + 5 * calls, 0
  for c = 1, calls do
    local at = 5 + tenants + 5 * c
    -- A call's usual count, level and tenant ('1', '0', '0') are read without strtod at all:
    -- comparing with a constant string is comparing two pointers (ENQUEUE -4.5 % instructions at
    -- 16 calls, `rstreamer bench instructions`; issue 26).
    local size = argv[at] == '1' and 1 or argv[at] + 0
    local remaining, deadline = argv[at + 1] + 0, argv[at + 2] + 0
    local level = argv[at + 3] == '0' and 0 or argv[at + 3] + 0
    local tenant = argv[at + 4] == '0' and 0 or argv[at + 4] + 0
    if not (size % 1 == 0 and remaining % 1 == 0 and deadline % 1 == 0 and level % 1 == 0 and tenant % 1 == 0
            and size >= 0 and size <= count and remaining >= 0 and remaining <= max_ms and deadline >= 0
            and deadline <= 2 ^ 53 and level >= 0 and tenant >= 0 and tenant <= tenants) then
      error('a number out of range')  -- named below
    end
    last = last + size
    if level > top then top = level end
    -- One value a call kept: a store that grows a table costs about 300 instructions, and the
    -- count, level and tenant are read again below by comparing strings.
    remaining_of[c] = remaining
  end
  return max_queue, max_bytes, permille, calls, tenants, last, top
end
local remaining_of, count = {}, #ARGV
local read, max_queue, max_bytes, permille, calls, tenants, last, top =
  pcall(read_numbers, ARGV, count, #KEYS, remaining_of, MAX_MS)
if not read then
  -- integer() stops the script naming the first number that is not an integer in its range.
  integer(ARGV[1], 0, math.huge, 'max_queue')
  integer(ARGV[2], 0, math.huge, 'max_queue_bytes')
  integer(ARGV[3], 0, 1000, 'admit wait')
  local n, t = integer(ARGV[7], 0, count, 'number of calls'), integer(ARGV[8], 0, #KEYS, 'number of tenants')
  for c = 1, n do
    local at = 5 + t + 5 * c
    integer(ARGV[at], 0, count, 'item count')
    integer(ARGV[at + 1], 0, MAX_MS, 'remaining timeout (ms)')
    integer(ARGV[at + 2], 0, 2 ^ 53, 'deadline (ms)')
    integer(ARGV[at + 3], 0, math.huge, 'priority level')
    integer(ARGV[at + 4], 0, t, 'tenant number')
  end
  error(max_queue)  -- not a number of the calls (out of memory, SCRIPT KILL): as it was raised
end
local streams = (#KEYS - 2 - tenants) / 4
local payload = 10 + tenants + 5 * calls
integer(last, 0, count, 'number of payloads')
-- The client's copy of the levels (read with the heartbeats, at most two seconds old) spares
-- every ENQUEUE a GET (issue 26). A copy that would refuse a call's level is checked against
-- the key itself, so a fleet that just added levels is never refused from an old copy; so is a
-- copy that says fair, since items held for a fleet gone back to fifo would never run.
local levels, bounds, fair, direct
if ARGV[9] ~= '?' then levels, bounds, fair = levels_of(ARGV[9]) end
if not levels or fair or top >= levels then levels, bounds, fair, direct = published_levels(KEYS[1]) end
-- Only what a call uses is read: the quotas when a call names a tenant, the clock when an age,
-- a bucket or a held item needs it (a lone call on an idle prefix: XLEN and XADD; issue 26).
local quotas = tenants > 0 and published_quotas(KEYS[2])
local clock = lazy_clock()
local lks, backlog, undelivered, age, queued_bytes, bound = {}, {}, {}, {}, 0, {}
for l = 1, streams do
  local bytes
  lks[l] = level_keys(3 + tenants, l)
  bound[l] = level_bound(bounds, l, max_queue)  -- once a level, not once a call
  backlog[l], undelivered[l], age[l], bytes = level_queue(lks[l], group, fair, max_bytes > 0, clock)
  queued_bytes = queued_bytes + bytes
end
local function tenant_name(number) return number > 0 and ARGV[9 + number] or '' end
-- tenant number -> its bucket (tokens refilled to now), read once per script
local buckets = {}
local function bucket(number)
  buckets[number] = buckets[number] or bucket_of(quotas, ARGV[9 + number], KEYS[2 + number], clock())
  return buckets[number]
end
local traced = last + 1
local index_text = index_texts(last - payload + 1)
local index = 0
-- The reply's and ids' lengths are counted: #t is a binary search of t each time.
local reply, ids, replied, added = {calls}, {}, 1, 0
for c = 1, calls do
  local at = 5 + tenants + 5 * c  -- the call's numbers, checked above
  local size = ARGV[at] == '1' and 1 or ARGV[at] + 0
  local remaining, remaining_text, deadline = remaining_of[c], ARGV[at + 1], ARGV[at + 2]
  local level = ARGV[at + 3] == '0' and 0 or ARGV[at + 3] + 0
  local tenant = ARGV[at + 4] == '0' and 0 or ARGV[at + 4] + 0
  local tp = ARGV[traced + c - 1]
  local reason, detail, limit = 0, 0, 0
  local b = nil
  local bytes = 0
  if max_bytes > 0 then
    for k = payload, payload + size - 1 do bytes = bytes + #ARGV[k] end
  end
  if level >= levels or level + 1 > streams then
    reason, detail = 4, levels
  elseif tenant > 0 and bucket(tenant).rate > 0 then
    b = bucket(tenant)
    if size > b.burst then reason, detail, limit = 5, -1, b.burst
    elseif b.tokens < size then reason, detail, limit = 5, math.ceil((size - b.tokens) * 1000 / b.rate), b.burst end
  end
  if reason == 0 then
    limit = bound[level + 1]
    local ahead = 0
    for l = 1, level + 1 do ahead = ahead + backlog[l] end
    -- room() written out for a fifo level (no tenant shares to weigh)
    local free = size
    if fair then free = room(lks[level + 1][4], fair, tenant_name(tenant), ahead, limit, size)
    elseif limit > 0 and limit - ahead < size then free = math.max(0, limit - ahead) end
    if free < size then
      reason, detail = 1, ahead
    elseif max_bytes > 0 and queued_bytes + bytes > max_bytes then reason, detail, limit = 2, queued_bytes, max_bytes
    elseif age[level + 1] * 1000 > permille * remaining then reason, detail, limit = 3, age[level + 1], 0
    else limit = 0 end
  end
  if reason == 0 then
    if b then take(b, size, clock()) end
    local l = level + 1
    if fair then
      local function fields_of(k)
        return entry_fields(version, token, index_text[index + k] or index + k, remaining_text, deadline,
                            ARGV[payload + k], tp)
      end
      local held
      held, undelivered[l] = add(lks[l], fair, tenant_name(tenant), token, index, size, fields_of,
                                  remaining, undelivered[l], clock, backlog[l] - undelivered[l], direct)
      for _, id in ipairs(held) do added = added + 1; ids[added] = id end
    else
      -- A fifo level's items go straight onto its stream, as add() would put them, without a
      -- closure and a table per call (an ENQUEUE of 16 calls: 68 -> 62 us of Redis; issue 26).
      local stream = lks[l][1]
      for k = 0, size - 1 do
        local i = index + k
        added = added + 1
        ids[added] = redis.call('XADD', stream, '*',
                                   entry_fields(version, token, index_text[i] or i, remaining_text, deadline,
                                                ARGV[payload + k], tp))
      end
      undelivered[l] = undelivered[l] + size
    end
    backlog[level + 1] = backlog[level + 1] + size
    queued_bytes = queued_bytes + bytes
  end
  reply[replied + 1], reply[replied + 2], reply[replied + 3] = reason, detail, limit
  replied = replied + 3
  index = index + size
  payload = payload + size
end
for k = 1, added do reply[replied + k] = ids[k] end
return reply
