-- KEYS[1] a work stream (a request stream, the webhooks stream), KEYS[2] workers hash.
-- ARGV: group, consumer, dead_after ms.
-- Remove a dead consumer only if, at this instant, it holds no entry and has not read for
-- dead_after: a consumer that was stalled but is alive may read between a listing and the
-- delete, and XGROUP DELCONSUMER would drop the entries it just read from every pending list.
-- Returns 1 if removed.
for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for i = 1, #consumer, 2 do info[consumer[i]] = consumer[i + 1] end
  if info['name'] == ARGV[2] then
    if info['pending'] > 0 or info['idle'] <= tonumber(ARGV[3]) then return 0 end
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
    redis.call('HDEL', KEYS[2], ARGV[2])
    return 1
  end
end
return 0
