-- wrk script for bench/compare.py: POST the same JSON body to BENCH_STREAMS streams named
-- BENCH_PREFIX0, BENCH_PREFIX1, ... in turn (one stream when BENCH_STREAMS is 1), with
-- BENCH_CONTENT_TYPE (default application/json) as its Content-Type, and BENCH_TOKEN (if
-- set) as a bearer token.
--
--   BENCH_BODY_FILE=body.json BENCH_STREAMS=1000 BENCH_PREFIX=/v1/stream/bench/s \
--     wrk -t1 -c64 -d10s -s append.lua http://127.0.0.1:4437
--
-- Requests are built once, in init(). Every answer's status is counted; done() prints one
-- line, "BENCH {json}", with the totals, the latency percentiles (microseconds) and the
-- count of each status, which compare.py reads. wrk itself counts statuses >= 400 as
-- errors (summary.errors.status).

local body_file = assert(io.open(os.getenv("BENCH_BODY_FILE"), "rb"))
local body = body_file:read("*a")
body_file:close()
local stream_count = tonumber(os.getenv("BENCH_STREAMS") or "1")
local prefix = os.getenv("BENCH_PREFIX")
local prepared = {}
local turn = 0
local threads = {}
statuses = {} -- global: done() reads it from each thread's state with thread:get()

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  local headers = { ["Content-Type"] = os.getenv("BENCH_CONTENT_TYPE") or "application/json" }
  local token = os.getenv("BENCH_TOKEN")
  if token then
    headers["Authorization"] = "Bearer " .. token
  end
  for n = 0, stream_count - 1 do
    prepared[n + 1] = wrk.format("POST", prefix .. n, headers, body)
  end
end

function request()
  turn = turn % stream_count + 1
  return prepared[turn]
end

function response(status, headers, response_body)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  local totals = {}
  for _, thread in ipairs(threads) do
    for status, count in pairs(thread:get("statuses")) do
      totals[status] = (totals[status] or 0) + count
    end
  end
  local parts = {}
  for status, count in pairs(totals) do
    table.insert(parts, string.format('"%d":%d', status, count))
  end
  local errors = summary.errors
  io.write(string.format(
    'BENCH {"requests":%d,"duration_us":%d,"connect_errors":%d,"read_errors":%d,' ..
    '"write_errors":%d,"status_errors":%d,"timeouts":%d,"p50_us":%.0f,"p99_us":%.0f,' ..
    '"max_us":%.0f,"statuses":{%s}}\n',
    summary.requests, summary.duration, errors.connect, errors.read, errors.write,
    errors.status, errors.timeout, latency:percentile(50), latency:percentile(99),
    latency.max, table.concat(parts, ",")))
end
