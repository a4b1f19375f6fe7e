#!lua flags=allow-oom
-- KEYS[1] request stream. ARGV: group. Creates the stream and its group if missing.
local reply = redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
if type(reply) == 'table' and reply.err and not string.find(reply.err, 'BUSYGROUP') then
  return redis.error_reply(reply.err)
end
return 1
