-- KEYS: job, inputs, request stream. ARGV: token, wire version. Returns the items fed.
--- @include "include/job.lua"
return feed(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2])
