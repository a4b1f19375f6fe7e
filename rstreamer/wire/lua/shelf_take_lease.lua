#!lua flags=allow-oom
-- KEYS[1] a model's load lease, KEYS[2] the shelf workers' heartbeats hash, KEYS[3] the holders hash.
-- ARGV: this worker, the model, the number of live holders the caller saw, dead_after in ms, the
-- lease's TTL in ms.
-- Takes the fleet-wide load lease of a model unless a live worker has it, and only while the
-- model's live holders are as many as the caller counted: two workers never load one cold model
-- for the same waiting items, and a worker that decided on stale evidence (a peer loaded the
-- model meanwhile, or a holder died) does nothing and decides again. A lease whose worker died
-- (its heartbeat lapsed) is taken over. Returns 1 when taken, 0 when not.
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local dead_after = tonumber(ARGV[4])
local function live(name)
  local raw = redis.call('HGET', KEYS[2], name)
  if not raw then return false end
  local ok, info = pcall(cjson.decode, raw)
  if not ok or type(info) ~= 'table' or tonumber(info['seen_ms']) == nil then return false end
  return now_ms - tonumber(info['seen_ms']) <= dead_after
end
local current = redis.call('GET', KEYS[1])
if current and current ~= ARGV[1] and live(current) then return 0 end
local holders = 0
local flat = redis.call('HGETALL', KEYS[3])
for i = 1, #flat, 2 do
  if live(flat[i]) then
    local ok, info = pcall(cjson.decode, flat[i + 1])
    if ok and type(info) == 'table' and type(info['held']) == 'table' then
      for _, name in ipairs(info['held']) do
        if name == ARGV[2] then holders = holders + 1 end
      end
    end
  end
end
if holders ~= tonumber(ARGV[3]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[5])
return 1
