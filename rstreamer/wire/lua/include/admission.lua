--- @include "include/fair.lua"
-- What a call's admission and a job's feed share (ENQUEUE_CALLS, and feed in include/job.lua): the
-- levels and quotas the workers published, a level's queue, its bound, a tenant's token bucket,
-- the layout of a request entry and how items are added to a level. A job's items are admitted
-- by the same rules as a call's, a window at a time (docs/jobs.md).
-- The levels the workers published (JSON {weights, max_queue, fair, direct}; absent or '': one
-- level, as before priority levels): their number, their bounds, whether they are shared fairly,
-- and with fair sharing the most undelivered items a level's stream may have for a call that
-- finds nothing held to go onto it directly (two batches of each live worker: Levels.direct;
-- absent: 1).
local function levels_of(published)
  if not published or published == '' then return 1, {}, false, 1 end
  local config = cjson.decode(published)
  local direct = tonumber(config['direct']) or 1
  if direct < 1 or direct % 1 ~= 0 then direct = 1 end
  return #config['weights'], config['max_queue'] or {}, config['fair'] == true, direct
end
local function published_levels(key)
  return levels_of(redis.call('GET', key))
end
-- The tenant quotas the workers published (JSON {rate, burst, tenants}), or nil for none.
local function published_quotas(key)
  local published = redis.call('GET', key)
  return published and cjson.decode(published)
end
-- The bound of level l (1 = level 0): its published max_queue, else the caller's (0: none).
local function level_bound(bounds, l, max_queue)
  local limit = tonumber(bounds[l] or 0)
  if limit <= 0 then limit = max_queue end
  return limit
end
-- One level's queue (lk: its stream, held-item queue, held items, clocks): the items waiting
-- (held ones included with fair sharing), the items undelivered on its stream, the age in ms
-- of the oldest waiting one, and the bytes they take (counted only when count_bytes). clock():
-- the server's ms (read only when an age is needed).
-- XLEN comes first: it is 0 for a stream that does not exist, and an entry leaves the stream
-- when it is acked (FINISH deletes what it acks), withdrawn or dead-lettered, so an empty
-- stream has nothing waiting and nothing to weigh, and a call that finds its queue empty costs
-- one probe, not five (issue 26).
local function level_queue(lk, group, fair, count_bytes, clock)
  local backlog, age, bytes = 0, 0, 0
  local length = redis.call('XLEN', lk[1])
  if length > 0 then
    backlog = length
    local first = '-'
    local info = group_info(lk[1], group)
    if info then
      backlog = backlog - info['pending']
      first = '(' .. info['last-delivered-id']
    end
    if backlog > 0 then
      local head = redis.call('XRANGE', lk[1], first, '+', 'COUNT', 1)
      if head[1] then age = math.max(0, clock() - tonumber(string.match(head[1][1], '^(%d+)'))) end
    end
    if count_bytes then bytes = redis.call('MEMORY', 'USAGE', lk[1], 'SAMPLES', 0) end
  end
  local undelivered = backlog
  if fair then
    local held = redis.call('ZCARD', lk[2])
    local since = held > 0 and held_since(lk[2], lk[3])
    backlog = backlog + held
    if since then age = math.max(age, clock() - since) end
    if count_bytes and since then bytes = bytes + redis.call('MEMORY', 'USAGE', lk[3], 'SAMPLES', 0) end
  end
  return backlog, undelivered, age, bytes
end
-- How many of need items tenant may add to a level whose bound is limit, with ahead items
-- waiting on it and the more urgent levels (clock: the level's clocks). A full fair level
-- still admits a tenant holding less than an equal share of the bound (the tenants holding
-- items, itself included), up to twice the bound: a tenant that filled the level does not shut
-- the others out.
local function room(clock, fair, tenant, ahead, limit, need)
  if limit <= 0 then return need end
  local free = limit - ahead
  if fair and free < need then
    local own, waiting = holding(clock, tenant)
    if own == 0 then waiting = waiting + 1 end
    free = math.max(free, math.min(math.floor(limit / math.max(1, waiting)) - own, 2 * limit - ahead))
  end
  return math.max(0, math.min(need, free))
end
-- The token bucket at key of tenant name: {rate, burst, tokens refilled to now}; rate 0 when
-- the tenant has no quota. A bucket (tokens, ms of the last refill) refills at rate items/s up
-- to burst.
local function bucket_of(quotas, name, key, now_ms)
  local rate, burst = 0, 0
  if quotas then
    local own = quotas['tenants'] and quotas['tenants'][name]
    if own then rate, burst = tonumber(own[1]), tonumber(own[2])
    else rate, burst = tonumber(quotas['rate']), tonumber(quotas['burst']) end
  end
  local b = {rate = rate, burst = burst, tokens = burst, key = key}
  if rate > 0 then
    local state = redis.call('HMGET', key, 'tokens', 'ms')
    if state[1] then
      local elapsed = math.max(0, now_ms - tonumber(state[2]))
      b.tokens = math.min(burst, tonumber(state[1]) + elapsed * rate / 1000)
    end
  end
  return b
end
-- Take n tokens of bucket b; the bucket lives as long as it takes to fill again.
local function take(b, n, now_ms)
  b.tokens = b.tokens - n
  redis.call('HSET', b.key, 'tokens', tostring(b.tokens), 'ms', now_ms)
  redis.call('PEXPIRE', b.key, math.min(MAX_MS, math.ceil(b.burst * 1000 / b.rate) + 1000))
end
-- The decimal strings of the indexes below 64, for the entries of an ENQUEUE of `items` items
-- (index_text[i] or i: Redis converts a larger one). Redis turns a number handed to redis.call
-- into a string with printf's float formatting: an ENQUEUE of 16 one-item calls took 2.5 % fewer
-- instructions with its indexes from this table (callgrind, Redis 7.0; issue 26). It is built
-- only for more than one item: its 64 strings cost about what one conversion does.
local function index_texts(items)
  if items < 2 then return {} end
  return {
    [0] = '0', '1', '2', '3', '4', '5', '6', '7', '8', '9', '10', '11', '12', '13', '14', '15',
    '16', '17', '18', '19', '20', '21', '22', '23', '24', '25', '26', '27', '28', '29', '30', '31',
    '32', '33', '34', '35', '36', '37', '38', '39', '40', '41', '42', '43', '44', '45', '46', '47',
    '48', '49', '50', '51', '52', '53', '54', '55', '56', '57', '58', '59', '60', '61', '62', '63'
  }
end
-- The fields of one request entry, as messages.py documents them (tp: a W3C traceparent, or
-- nil or '' for none), as values, not a table: XADD takes them as they are, and a table per
-- item cost an ENQUEUE of 16 calls 4 of its 75 us of Lua (issue 26). {entry_fields(...)} when
-- a table is needed.
local function entry_fields(version, token, index, remaining, deadline, payload, tp)
  if tp and tp ~= '' then
    return 'v', version, 't', token, 'i', index, 'r', remaining, 'd', deadline, 'p', payload, 'tp', tp
  end
  return 'v', version, 't', token, 'i', index, 'r', remaining, 'd', deadline, 'p', payload
end
-- Add count items of one call or job (fields_of(k): the fields of its k-th item's entry, as
-- entry_fields gives them, numbered from first) to a level (lk as for level_queue): with fair
-- sharing held, ids 'token:index', and when the stream has nothing undelivered one moves to it
-- at once, which wakes the workers; otherwise onto the stream. Returns the ids added and the
-- level's undelivered count after.
-- now_ms: the server's ms, or a function that reads them. held: the items the level holds, when
-- known; direct: the level's published direct bound (levels_of). The items of a call that finds
-- a fair level holding nothing go onto its stream at once while the stream has at most direct
-- undelivered (two batches of each worker), where holding and moving them, while one tenant had
-- the level to itself, cost it about 13 commands and 60 us of Redis an item more than a level in
-- arrival order (issue 26). A tenant that arrives then waits behind at most direct items before
-- the tenants take turns. Items are held only while the stream has an entry undelivered, or one
-- moves there at once: a read returns after the hold, and its probe sends the worker back to
-- READ_LEVELS (LevelSource._read_single). The clocks are not reset here: with nothing held, the
-- next hold starts every tenant at the current turn.
local function add(lk, fair, tenant, token, first, count, fields_of, remaining, undelivered, now_ms, held, direct)
  local ids = {}
  if fair and held == 0 and undelivered + count <= (direct or 1) then
    for k = 0, count - 1 do ids[k + 1] = redis.call('XADD', lk[1], '*', fields_of(k)) end
    undelivered = undelivered + count
  elseif fair then
    if type(now_ms) == 'function' then now_ms = now_ms() end  -- the clock is read only to hold
    hold(lk[2], lk[3], lk[4], tenant, token, first, fields_of, count, now_ms, remaining + 60000)
    for k = 0, count - 1 do ids[#ids + 1] = token .. ':' .. (first + k) end
    if undelivered == 0 then undelivered = promote(lk[1], lk[2], lk[3], lk[4], 1, now_ms) end
  else
    for k = 0, count - 1 do ids[#ids + 1] = redis.call('XADD', lk[1], '*', fields_of(k)) end
    undelivered = undelivered + count
  end
  return ids, undelivered
end
-- The four keys of level l (1 = level 0) in KEYS, the first level's starting at KEYS[at].
local function level_keys(at, l)
  local k = at + 4 * (l - 1)
  return {KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]}
end
