-- wrk script for POST /predict, like service-streamer's benchmark.lua:
--   wrk -t 2 -c 64 -d 20s --timeout 10s -s webapp/benchmark.lua http://127.0.0.1:8000/predict
-- Each request carries one sentence, cycling through the list below, in service-streamer's
-- form style (s=...). BENCH_FORMAT=json sends {"inputs": [...]} instead. Non-200 answers are
-- counted by status at the end (wrk's own "Non-2xx" line lumps them together).

local sentences = {
  "Happy birthday to you.",
  "A man is playing a guitar.",
  "The cat is sleeping on the sofa.",
  "It is going to rain all afternoon, so take an umbrella.",
  "How do I cook pasta?",
  "The flight was delayed by two hours.",
  "My laptop will not turn on.",
  "Children are playing football in the park.",
}

local json_body = os.getenv("BENCH_FORMAT") == "json"
local counter = 0
local threads = {}
statuses = {}  -- global: done() reads it from each thread with thread:get()

local function urlencode(text)
  return (text:gsub("[^%w%-%._~ ]", function(c) return string.format("%%%02X", string.byte(c)) end):gsub(" ", "+"))
end

local function body_for(sentence)
  if json_body then
    return '{"inputs": ["' .. sentence:gsub('[\\"]', "\\%0") .. '"]}'
  end
  return "s=" .. urlencode(sentence)
end

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  wrk.method = "POST"
  wrk.headers["Content-Type"] = json_body and "application/json" or "application/x-www-form-urlencoded"
end

function request()
  counter = counter + 1
  return wrk.format(nil, nil, nil, body_for(sentences[counter % #sentences + 1]))
end

function response(status, headers, body)
  if status ~= 200 then
    statuses[status] = (statuses[status] or 0) + 1
  end
end

function done(summary, latency, requests)
  local failed = {}
  for _, thread in ipairs(threads) do
    for status, count in pairs(thread:get("statuses") or {}) do
      failed[status] = (failed[status] or 0) + count
    end
  end
  for status, count in pairs(failed) do
    io.write(string.format("status %d: %d responses\n", status, count))
  end
  io.write(string.format("p50 %.1f ms, p99 %.1f ms\n", latency:percentile(50) / 1000, latency:percentile(99) / 1000))
end
