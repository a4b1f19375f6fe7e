-- KEYS[1] request stream. ARGV: group, consumer, exclusive start id ('-' for the first), count.
-- This consumer's own pending entries after the start id, with their fields (nil for an entry
-- deleted meanwhile). Read with XPENDING and XRANGE, not XREADGROUP from an id: re-reading
-- one's own backlog after a failed reply is not a new delivery and must not count toward
-- max_deliveries.
local start = ARGV[3]
if start ~= '-' then start = '(' .. start end
local rows = redis.call('XPENDING', KEYS[1], ARGV[1], start, '+', ARGV[4], ARGV[2])
local entries = {}
for i, row in ipairs(rows) do
  local found = redis.call('XRANGE', KEYS[1], row[1], row[1])
  entries[i] = {row[1], found[1] and found[1][2] or false}
end
return entries
