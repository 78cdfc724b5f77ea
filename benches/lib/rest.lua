-- wrk script for the koder-dns REST benchmarks.
--
-- Configured through environment variables (wrk passes its own args after --):
--   BENCH_MODE      heartbeat | register | reregister | healthz
--   BENCH_KEY       API key (X-API-Key)
--   BENCH_BODIES    file of JSON bodies, one a line (heartbeat, reregister):
--                   each thread cycles through all of them, starting at its own offset
--   BENCH_RATE      total target requests/s over all threads; 0 = as fast as possible.
--                   Debian's wrk has no -R (that is wrk2), so the pacing is done
--                   here with delay(): each thread hands out send slots
--                   1/(rate/threads) apart and a connection waits for its slot.
--                   Needs enough connections: rate x latency << connections.
--   BENCH_THREADS   the -t given to wrk (to split BENCH_RATE)
--   BENCH_LEASE_NS  ttl_ns of registrations (register mode), default 120 s
--   BENCH_ROUND     part of the ids of register mode, so that every run registers new ids
--
-- done() prints one machine-readable line starting with "RESULT ".

local mode = os.getenv("BENCH_MODE") or "healthz"
local key = os.getenv("BENCH_KEY") or ""
local bodies_file = os.getenv("BENCH_BODIES")
local rate = tonumber(os.getenv("BENCH_RATE") or "0") or 0
local nthreads = tonumber(os.getenv("BENCH_THREADS") or "1") or 1
local lease_ns = os.getenv("BENCH_LEASE_NS") or "120000000000"
local round = tonumber(os.getenv("BENCH_ROUND") or "0") or 0

local threads = {}
local tid_counter = 0

function setup(thread)
    thread:set("tid", tid_counter)
    tid_counter = tid_counter + 1
    table.insert(threads, thread)
end

-- heartbeat/reregister requests, formatted once in init(): the load tool then spends the
-- same few instructions on every request whatever the route, so the routes' rates compare
-- the server's costs rather than wrk's
local prebuilt = {}
local pos = 1
local counter = 0
local headers = { ["Content-Type"] = "application/json", ["X-API-Key"] = key }

-- pacing clock (LuaJIT ffi); without ffi, rate limiting is disabled
local now_ms = nil
if rate > 0 then
    local ok, ffi = pcall(require, "ffi")
    if ok then
        pcall(ffi.cdef, [[
            typedef struct { long tv_sec; long tv_nsec; } bench_timespec;
            int clock_gettime(int clk_id, bench_timespec *tp);
        ]])
        local ts = ffi.new("bench_timespec")
        now_ms = function()
            ffi.C.clock_gettime(1, ts) -- CLOCK_MONOTONIC
            return tonumber(ts.tv_sec) * 1000 + tonumber(ts.tv_nsec) / 1e6
        end
    else
        io.stderr:write("rest.lua: no ffi, BENCH_RATE ignored\n")
        rate = 0
    end
end
local interval_ms = 0
local next_slot = nil

function init(args)
    tid = tonumber(tid) or 0
    if mode == "healthz" then
        prebuilt = { wrk.format("GET", "/healthz") }
    elseif bodies_file and (mode == "heartbeat" or mode == "reregister") then
        local path = (mode == "heartbeat") and "/api/v1/services/heartbeat" or "/api/v1/services/register"
        for line in io.lines(bodies_file) do
            if #line > 0 then table.insert(prebuilt, wrk.format("POST", path, headers, line)) end
        end
        if #prebuilt == 0 then error("no bodies in " .. bodies_file) end
        pos = (math.floor(#prebuilt * tid / nthreads) % #prebuilt) + 1
    end
    if rate > 0 then
        interval_ms = 1000.0 * nthreads / rate
    end
end

function delay()
    if rate <= 0 then return 0 end
    local now = now_ms()
    if next_slot == nil or next_slot < now - 50 then
        -- start, or more than 50 ms behind: do not burst to catch up
        next_slot = now
    end
    local d = next_slot - now
    next_slot = next_slot + interval_ms
    if d < 0 then d = 0 end
    return d
end

function request()
    counter = counter + 1
    if #prebuilt > 0 then
        local req = prebuilt[pos]
        pos = pos + 1
        if pos > #prebuilt then pos = 1 end
        return req
    elseif mode == "register" then
        -- a new instance every time: unique id, 50 service names, spread addresses
        local n = counter
        local body = string.format(
            '{"id":"churn-%d-%d-%d","name":"churn%02d","address":"10.%d.%d.%d","port":%d,"ttl_ns":%s,"metadata":{"bench":"churn"}}',
            round, tid, n, n % 50, 100 + tid, math.floor(n / 256) % 256, n % 256, 9000 + (n % 1000), lease_ns)
        return wrk.format("POST", "/api/v1/services/register", headers, body)
    else
        error("unknown BENCH_MODE " .. mode)
    end
end

function done(summary, latency, requests)
    local e = summary.errors
    io.write(string.format(
        "RESULT requests=%d duration_us=%d bytes=%d err_connect=%d err_read=%d err_write=%d err_status=%d err_timeout=%d " ..
        "lat_mean_us=%.1f lat_p50_us=%d lat_p90_us=%d lat_p99_us=%d lat_p999_us=%d lat_max_us=%d\n",
        summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
        latency.mean, latency:percentile(50), latency:percentile(90), latency:percentile(99),
        latency:percentile(99.9), latency.max))
end
