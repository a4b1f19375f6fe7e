-- KEYS: job, inputs, starved jobs, then the feed keys (as JOB_CREATE). ARGV: id, token, wire
-- version, the workers' consumer group. Returns the items fed (-1: the keys are not the job's).
--- @include "include/job.lua"
return feed(KEYS[1], KEYS[2], KEYS[3], 4, ARGV[1], ARGV[2], ARGV[3], ARGV[4])
