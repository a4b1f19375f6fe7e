--- @include "include/checks.lua"
-- Fair sharing between tenants of one level (``--tenant-sharing fair``; docs/priority.md).
-- Each level then has, beside its stream, a sorted set of held items (member: the item's id
-- 'token:index', score: its start tag in virtual time), a hash of their entries (member ->
-- msgpack {held at ms, {field, value, ...}, tenant}) and a hash of virtual clocks ('~': the tag
-- of the last item promoted; per tenant, '' for calls without one: the tag after its last item;
-- '#' and the tenant: its items held; '*': the tenants with items held). This is
-- start-time fair queueing: a tenant's next item starts at max(clock, its own finish tag), so
-- every tenant with items waiting gets one item in turn, a newcomer goes next, and each tenant's
-- items keep their order. Items move to the stream, fairest first, when a worker reads the level
-- (READ_LEVELS) and, one, when a call arrives while the stream has nothing undelivered, which
-- wakes workers blocked on the stream. A job's items are held and moved the same way.
-- Hold count items of one call or job; the three keys live until the latest held item's
-- deadline has passed (ttl ms), so a prefix nobody serves any more forgets them.
local function hold(queue, items, clock, tenant, token, first, fields_of, count, now_ms, ttl)
  local start = math.max(tonumber(redis.call('HGET', clock, '~') or '0'),
                         tonumber(redis.call('HGET', clock, tenant) or '0'))
  for k = 0, count - 1 do
    local id = token .. ':' .. (first + k)
    redis.call('ZADD', queue, start + k, id)
    redis.call('HSET', items, id, cmsgpack.pack({now_ms, {fields_of(k)}, tenant}))
  end
  redis.call('HSET', clock, tenant, start + count)
  if redis.call('HINCRBY', clock, '#' .. tenant, count) == count then redis.call('HINCRBY', clock, '*', 1) end
  for _, key in ipairs({queue, items, clock}) do
    if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  end
end
-- One held item of tenant is gone (moved to the stream or withdrawn).
local function release(clock, tenant)
  if redis.call('HINCRBY', clock, '#' .. tenant, -1) <= 0 then
    redis.call('HDEL', clock, '#' .. tenant)
    redis.call('HINCRBY', clock, '*', -1)
  end
end
-- A held item of tenant, of start tag tag, was withdrawn (its caller cancelled or timed out):
-- the tenant's turns must not count it (issue 22 #10). A tenant's calls take consecutive tags in
-- order, so when the item was the tenant's last one (its finish tag is the item's tag + 1) the
-- finish tag goes back to the item's; called for the withdrawn items latest first, a withdrawn
-- call at the tail of the tenant's items gives all its turns back. A tenant left holding
-- nothing forgets its finish tag: its items that ran were promoted, so their turns are past,
-- and its next call starts at the current turn, as a newcomer's.
local function withdraw(clock, tenant, tag)
  release(clock, tenant)
  if not redis.call('HGET', clock, '#' .. tenant) then redis.call('HDEL', clock, tenant)
  elseif tonumber(redis.call('HGET', clock, tenant) or '-1') == tag + 1 then redis.call('HSET', clock, tenant, tag) end
end
-- The items tenant holds, and how many tenants hold items.
local function holding(clock, tenant)
  local f = redis.call('HMGET', clock, '#' .. tenant, '*')
  return tonumber(f[1] or '0'), tonumber(f[2] or '0')
end
-- Move up to count held items, fairest first, onto the stream; their remaining timeout shrinks
-- by the time they were held (a version-2 entry counts it from its new id). Each moved entry
-- carries the field 'h' ('1'): a withdrawal of it is marked, not deleted, even before a worker
-- reads it (cancel.lua), so the worker looks for one before predict (LevelSource.fresh); an
-- entry without it went onto the stream directly (add). Returns the count.
-- now_ms: the server's ms, or a function that reads them (only asked when an item moves).
local function promote(stream, queue, items, clock, count, now_ms)
  local popped = redis.call('ZPOPMIN', queue, count)
  if #popped == 0 then  -- nothing held: the clocks start again (a read of an idle level: 2 commands)
    redis.call('DEL', clock, items)
    return 0
  end
  if type(now_ms) == 'function' then now_ms = now_ms() end
  for i = 1, #popped, 2 do
    local record = redis.call('HGET', items, popped[i])
    if record then
      redis.call('HDEL', items, popped[i])
      local held = cmsgpack.unpack(record)
      local fields = held[2]
      for f = 1, #fields, 2 do
        if fields[f] == 'r' then fields[f + 1] = math.max(0, tonumber(fields[f + 1]) - (now_ms - held[1])) end
      end
      fields[#fields + 1], fields[#fields + 2] = 'h', '1'
      redis.call('XADD', stream, '*', unpack(fields))
      release(clock, held[3])
    end
  end
  -- Every tenant idle: the clocks start again (tags only order what waits).
  if redis.call('EXISTS', queue) == 0 then redis.call('DEL', clock, items)
  elseif #popped > 0 then redis.call('HSET', clock, '~', popped[#popped]) end
  return #popped / 2
end
-- What XINFO GROUPS says of group on stream (a map: pending, last-delivered-id, ...), or nil.
local function group_info(stream, group)
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local info = {}
    for k = 1, #g, 2 do info[g[k]] = g[k + 1] end
    if info['name'] == group then return info end
  end
  return nil
end
-- The entries of stream that no consumer of group has read yet (an acked entry leaves its
-- stream: what stays is pending or undelivered).
local function undelivered(stream, group)
  local length = redis.call('XLEN', stream)
  local info = length > 0 and group_info(stream, group)
  return info and length - info['pending'] or length
end
-- When the first held item was held (ms), or nil.
local function held_since(queue, items)
  local head = redis.call('ZRANGE', queue, 0, 0)
  if not head[1] then return nil end
  local record = redis.call('HGET', items, head[1])
  return record and cmsgpack.unpack(record)[1]
end
