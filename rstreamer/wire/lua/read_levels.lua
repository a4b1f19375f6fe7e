#!lua flags=allow-oom
-- KEYS: per priority level 0, 1, ... its request stream, held-item queue, held items and virtual
-- clocks (rstreamer.worker.levelsource.LevelSource). ARGV: group, consumer, max_items, fair (1: promote
-- held items, see include/fair.lua), then per level its guaranteed quota (priority.DeficitScheduler).
-- One read of up to max_items entries in two passes: each level takes up to its quota, most
-- urgent first; then what is left goes to the most urgent levels that still have entries. Reads
-- with XREADGROUP '>' (new deliveries, id order: FIFO within a level; with fair sharing, each
-- read first moves as many held items as the stream's undelivered entries leave of what it
-- asks for onto the stream, fairest first, and one more while items stay held). Returns per
-- level {taken in the first pass, taken in the second, 1 if a read of it came back short (it has
-- no more), newest entry id ('0-0' for none), the items it still holds (fair sharing; else 0),
-- entries {id, {field, value, ...}}...}; a blocked XREAD waits for an entry newer than those ids
-- when nothing was read (no entry is missed between the two). allow-oom: reading is how a full
-- Redis drains.
--- @include "include/fair.lua"
local group, consumer, left, fair = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4] == '1'
local levels = #KEYS / 4
local clock = lazy_clock()  -- only fair sharing's promotions need the time
local out = {}
for l = 1, levels do out[l] = {0, 0, 0, '0-0', 0} end
local function take(l, count, pass)
  local stream = KEYS[4 * l - 3]
  if fair then
    -- As many held items as the entries already on the stream leave room for: those a call put
    -- there directly (include/admission.lua, add) are read first, and no backlog of them stays
    -- in front of the items that take turns. And one more while items are held: it stays on
    -- the stream undelivered, the next in turn, and wakes a worker blocked on the stream's
    -- XREADGROUP (a fair level that held nothing is read that way, LevelSource._read_single),
    -- which then reads through this script too; without it, the moves and reads of this one
    -- worker would wake nobody, and its peers would wait out their whole idle_block.
    local room = count - undelivered(stream, group)
    if room >= 0 then promote(stream, KEYS[4 * l - 2], KEYS[4 * l - 1], KEYS[4 * l], room + 1, clock) end
  end
  local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', count, 'STREAMS', stream, '>')
  local entries = (reply and reply[1] and reply[1][2]) or {}
  for _, entry in ipairs(entries) do out[l][#out[l] + 1] = entry end
  out[l][pass] = out[l][pass] + #entries
  if #entries < count then out[l][3] = 1 end
  left = left - #entries
end
for l = 1, levels do
  local quota = math.min(tonumber(ARGV[4 + l]), left)
  if quota > 0 then take(l, quota, 1) end
end
for l = 1, levels do
  if left > 0 and out[l][3] == 0 then take(l, left, 2) end
end
if fair then
  for l = 1, levels do out[l][5] = redis.call('ZCARD', KEYS[4 * l - 2]) end
end
if left == tonumber(ARGV[3]) then
  for l = 1, levels do
    local newest = redis.call('XREVRANGE', KEYS[4 * l - 3], '+', '-', 'COUNT', 1)
    if newest[1] then out[l][4] = newest[1][1] end
  end
end
return out
