-- router-latency.lua - wrk request generator for scripts/router-latency.sh.
--
-- Every request is one of 8 shared prefixes (~4,000 characters of English-like words, fixed
-- by the prefix number, so every run and every target sees the same 8 texts) followed by a
-- suffix that no other request carries (run tag, wrk thread, request counter). A cache-aware
-- router should therefore keep each prefix on one replica; the suffix keeps the whole prompt
-- from ever repeating.
--
-- usage: wrk -s router-latency.lua URL -- MODE MODEL MAX_TOKENS TAG [PREFIX_CHARS]
--   MODE  completions (POST /v1/completions, not streamed) or
--         chat-stream (POST /v1/chat/completions with "stream": true) or
--         chat / chat-stream with CHAT_BODIES=FILE in the environment: real conversations
--         instead of the shared prefixes (see below)
--   TAG   distinguishes runs so that suffixes never repeat across cells
--
-- CHAT_BODIES: one chat request per line, `HEAD<TAB>TAIL`, where HEAD is the JSON of
-- `"messages":[...` cut inside the last message's content string and TAIL closes it. Every
-- request takes the next line (each wrk thread starts at its own offset) and puts a unique tag
-- where the cut is, so a line reused in a long run is still a new prompt whose history the
-- replicas may hold.
-- At the end it prints one line `RESULT {json}` with wrk's own counters and percentiles (µs).

local PREFIXES = 8
local words = {
  "the", "router", "sends", "each", "request", "to", "a", "replica", "that", "already",
  "holds", "its", "prefix", "in", "cache", "blocks", "of", "sixteen", "tokens", "are",
  "hashed", "and", "published", "as", "events", "while", "load", "is", "balanced", "across",
  "many", "machines", "with", "different", "models", "memory", "time", "first", "token",
  "latency", "throughput", "system", "prompt", "user", "assistant", "document", "question",
  "answer", "summary", "table", "number", "value", "result", "method", "paper", "section",
  "figure", "data", "set", "training", "evaluation", "inference", "server", "client",
}

-- A small LCG: LuaJIT's math.random differs between builds, the texts must not.
local function lcg(state)
  return (state * 1103515245 + 12345) % 2147483648
end

local function make_prefix(k, chars)
  local parts = { string.format("Document %d. ", k) }
  local len = #parts[1]
  local s = 7919 * (k + 1)
  while len < chars do
    s = lcg(s)
    local w = words[(math.floor(s / 65536) % #words) + 1]
    parts[#parts + 1] = w
    len = len + #w + 1
  end
  return table.concat(parts, " ")
end

-- WRK_ADDRS=host:port,host:port,...: thread i talks to address i (round-robin), so one wrk
-- run can spread its connections over several replicas (wrk itself takes a single URL).
local counter = 1
function setup(thread)
  thread:set("tid", counter)
  local list = os.getenv("WRK_ADDRS")
  if list and list ~= "" then
    local hosts = {}
    for h in string.gmatch(list, "[^,]+") do
      hosts[#hosts + 1] = h
    end
    local host, port = hosts[((counter - 1) % #hosts) + 1]:match("^(.*):(%d+)$")
    thread.addr = wrk.lookup(host, port)[1]
  end
  counter = counter + 1
end

local mode, model, max_tokens, tag
local prefixes = {}
local bodies = {}
local n = 0

function init(args)
  mode = args[1] or "completions"
  model = args[2] or "bench"
  max_tokens = tonumber(args[3] or "8")
  tag = args[4] or "run"
  local chars = tonumber(args[5] or "4000")
  for k = 0, PREFIXES - 1 do
    prefixes[k] = make_prefix(k, chars)
  end
  if mode ~= "completions" and mode ~= "chat-stream" and mode ~= "chat" then
    error("unknown mode " .. mode)
  end
  local path = os.getenv("CHAT_BODIES")
  if path and path ~= "" then
    for line in io.lines(path) do
      local head, tail = line:match("^([^\t]*)\t(.*)$")
      if head then
        bodies[#bodies + 1] = { head, tail }
      end
    end
    if #bodies == 0 then
      error("no HEAD<TAB>TAIL lines in " .. path)
    end
  elseif mode == "chat" then
    error("mode chat needs CHAT_BODIES")
  end
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  wrk.path = mode == "completions" and "/v1/completions" or "/v1/chat/completions"
end

function request()
  n = n + 1
  local t = tonumber(tid) or 0
  if #bodies > 0 then
    local b = bodies[((n + t * 7919) % #bodies) + 1]
    local stream = mode == "chat-stream" and ',"stream":true' or ""
    return wrk.format(nil, nil, nil, string.format(
      '{"model":"%s",%s [%s-%d-%d]%s,"max_tokens":%d,"temperature":0%s}',
      model, b[1], tag, t, n, b[2], max_tokens, stream))
  end
  local k = (n * 5 + t) % PREFIXES
  local text = prefixes[k] .. string.format(
    " Question %s-%d-%d: what does the %s say about %s?", tag, t, n,
    words[(n % #words) + 1], words[((n * 7) % #words) + 1])
  local body
  if mode == "completions" then
    body = string.format('{"model":"%s","prompt":"%s","max_tokens":%d,"temperature":0}',
      model, text, max_tokens)
  else
    body = string.format(
      '{"model":"%s","messages":[{"role":"user","content":"%s"}],"max_tokens":%d,'
      .. '"temperature":0,"stream":true}', model, text, max_tokens)
  end
  return wrk.format(nil, nil, nil, body)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'RESULT {"requests":%d,"duration_us":%d,"bytes":%d,"errors_connect":%d,"errors_read":%d,'
    .. '"errors_write":%d,"errors_status":%d,"errors_timeout":%d,"p50_us":%d,"p90_us":%d,'
    .. '"p99_us":%d,"max_us":%d,"mean_us":%.1f}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status,
    e.timeout, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max, latency.mean))
end
