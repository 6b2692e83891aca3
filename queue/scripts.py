"""Lua scripts of the queue plane. Every key a script touches is declared in KEYS.

Times come from the Redis server clock (``TIME``), so edges and workers on different hosts
agree on enqueue times, leases and deadlines.
"""

from __future__ import annotations

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

#: KEYS: req, pending:<lane>, watch, arrivals. ARGV: id, payload, lane, edge, start_timeout_ms, ttl_s, owner,
#: fallback (the pools ``auto`` could also have chosen, comma-separated: ``RequestPayload.fallback_pools``),
#: trace (the payload's ``trace`` as JSON, ``{}`` for none: stored as its own small field so that
#: a resume's or a requeue's span reads its context without the payload, which holds the prompt).
#: Returns {1, enq_ms} when enqueued, {0, state} when the id already exists (a no-op), with the
#: state '' when another owner submitted it (its state is not this caller's business).
#: ``arrivals`` counts enqueues per lane: the scheduler turns it into the arrival rate.
ENQUEUE = _NOW + """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local h = redis.call('HMGET', KEYS[1], 'state', 'owner')
  if (h[2] or '') ~= (ARGV[7] or '') then return {0, ''} end
  return {0, h[1] or ''}
end
redis.call('HSET', KEYS[1], 'p', ARGV[2], 'lane', ARGV[3], 'edge', ARGV[4], 'state', 'queued',
           'attempt', 0, 'enq_ms', now, 'worker', '', 'owner', ARGV[7] or '', 'fallback', ARGV[8] or '',
           'trace', ARGV[9] or '{}')
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[5]), ARGV[1])
redis.call('HINCRBY', KEYS[4], ARGV[3], 1)
return {1, now}
"""

#: KEYS: req, watch, claims. ARGV: id, worker, lease_ms, ttl_s.
#: Returns {attempt, payload, enq_ms, now, edge, times_preempted, owner, ready_ms, first_claim_ms}
#: or false when the request is not queued. ``ready_ms``: when this attempt's wait began (the
#: enqueue, or the last hand-back / requeue); ``first_claim_ms``: when its first attempt started.
#: ``claims`` counts claims per lane: the scheduler turns it into service rates.
CLAIM = _NOW + """
if redis.call('HGET', KEYS[1], 'state') ~= 'queued' then return false end
local attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
redis.call('HINCRBY', KEYS[3], redis.call('HGET', KEYS[1], 'lane'), 1)
redis.call('HSET', KEYS[1], 'state', 'running', 'worker', ARGV[2], 'claim_ms', now)
redis.call('HSETNX', KEYS[1], 'first_claim_ms', now)
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
local h = redis.call('HMGET', KEYS[1], 'p', 'enq_ms', 'edge', 'preempted', 'owner', 'ready_ms', 'first_claim_ms')
return {attempt, h[1], h[2], now, h[3], tonumber(h[4] or '0'), h[5] or '', tonumber(h[6] or h[2]), tonumber(h[7])}
"""

#: KEYS: watch, req1..reqN. ARGV: lease_ms, id1, attempt1, ..., idN, attemptN.
#: Renews each lease this worker still holds. Returns per request {status, edge} with
#: status 'ok', 'cancelled' or 'lost' (another attempt owns it, or it is gone).
HEARTBEAT = _NOW + """
local out = {}
for i = 2, #KEYS do
  local id, attempt = ARGV[2 * (i - 1)], ARGV[2 * (i - 1) + 1]
  local h = redis.call('HMGET', KEYS[i], 'state', 'attempt', 'edge')
  if h[2] ~= attempt or (h[1] ~= 'running' and h[1] ~= 'cancelled') then
    out[#out + 1] = {'lost', h[3] or ''}
  else
    redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), id)
    out[#out + 1] = {h[1] == 'cancelled' and 'cancelled' or 'ok', h[3] or ''}
  end
end
return out
"""

#: KEYS: req, watch. ARGV: id, attempt, final_state, finished_ttl_s.
#: Returns 1 when this attempt owned the request and it is now final, else 0.
COMPLETE = """
local h = redis.call('HMGET', KEYS[1], 'state', 'attempt')
if h[2] ~= ARGV[2] or (h[1] ~= 'running' and h[1] ~= 'cancelled') then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[3])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""

#: KEYS: req, watch, pending:short, pending:medium, pending:long. ARGV: id, finished_ttl_s, edge.
#: Returns {previous_state, worker}: a queued request leaves its lane at once; a running one
#: is marked cancelled and its worker must be told (the caller publishes on its channel).
#: With ``edge`` set, only a request still pointed at that edge is cancelled ({'moved', ''}
#: otherwise): an edge whose client left must not cancel a request resumed on another edge.
CANCEL = """
local h = redis.call('HMGET', KEYS[1], 'state', 'worker', 'edge')
if not h[1] then return {'absent', ''} end
if ARGV[3] ~= '' and h[3] ~= ARGV[3] then return {'moved', ''} end
if h[1] == 'queued' then
  for i = 3, 5 do redis.call('ZREM', KEYS[i], ARGV[1]) end
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HSET', KEYS[1], 'state', 'cancelled')
  redis.call('EXPIRE', KEYS[1], ARGV[2])
elseif h[1] == 'running' then
  redis.call('HSET', KEYS[1], 'state', 'cancelled')
end
return {h[1], h[2]}
"""

#: KEYS: req, watch, pending:short, pending:medium, pending:long. ARGV: id, finished_ttl_s.
#: Fails a request that is still queued (its pool has had no worker for too long): it leaves
#: its lane and no claim can take it any more. Returns {1, edge, attempt}, or {0, '', 0} when
#: it is no longer queued (claimed meanwhile, cancelled, gone).
FAIL_QUEUED = """
local h = redis.call('HMGET', KEYS[1], 'state', 'edge', 'attempt')
if h[1] ~= 'queued' then return {0, '', 0} end
for i = 3, 5 do redis.call('ZREM', KEYS[i], ARGV[1]) end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], 'state', 'failed')
redis.call('EXPIRE', KEYS[1], ARGV[2])
return {1, h[2] or '', tonumber(h[3] or '0')}
"""

#: KEYS: req, watch, pending:short, pending:medium, pending:long.
#: ARGV: id, start_timeout_ms, max_attempts, finished_ttl_s, now_ms (the Redis clock, read by
#: the caller just before). Handles one expired watch entry. Returns {action, edge, attempt,
#: expired, worker} with action one of skip (renewed meanwhile), gone, finished, waiting, restored,
#: requeued, failed; ``expired`` and ``worker`` (the one whose lease expired) for the last two.
#: ``expired`` counts this request's lease expiries (its workers' deaths): a
#: request fails after ``max_attempts`` of them. Hand-backs (preemption, a drain, a busy engine)
#: also start a new attempt but are no failure: before, they used up the same budget.
REQUEUE = """
local now = tonumber(ARGV[5])
local score = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not score or tonumber(score) > now then return {'skip', '', 0} end
local h = redis.call('HMGET', KEYS[1], 'state', 'lane', 'attempt', 'enq_ms', 'edge', 'worker')
if not h[1] then redis.call('ZREM', KEYS[2], ARGV[1]); return {'gone', '', 0} end
if h[1] ~= 'queued' and h[1] ~= 'running' then
  redis.call('ZREM', KEYS[2], ARGV[1]); return {'finished', h[5], tonumber(h[3])}
end
local lanes = {short = KEYS[3], medium = KEYS[4], long = KEYS[5]}
local pending = lanes[h[2]] or KEYS[4]
local deadline = now + tonumber(ARGV[2])
if h[1] == 'queued' then
  if redis.call('ZSCORE', pending, ARGV[1]) then
    redis.call('ZADD', KEYS[2], deadline, ARGV[1]); return {'waiting', h[5], tonumber(h[3])}
  end
  -- popped by a worker that died before claiming: back to its original place in line
  redis.call('ZADD', pending, h[4], ARGV[1])
  redis.call('ZADD', KEYS[2], deadline, ARGV[1]); return {'restored', h[5], tonumber(h[3])}
end
local expired = redis.call('HINCRBY', KEYS[1], 'expired', 1)
if expired >= tonumber(ARGV[3]) then
  redis.call('HSET', KEYS[1], 'state', 'failed')
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  return {'failed', h[5], tonumber(h[3]), expired, h[6] or ''}
end
redis.call('HSET', KEYS[1], 'state', 'queued', 'worker', '', 'ready_ms', now)
redis.call('ZADD', pending, h[4], ARGV[1])
redis.call('ZADD', KEYS[2], deadline, ARGV[1])
return {'requeued', h[5], tonumber(h[3]), expired, h[6] or ''}
"""

#: Lua, shared by APPEND and APPEND_PUBLISH: appends the (seq, event) pairs ARGV[first..last]
#: to ``stream`` with explicit ids ``<seq+1>-0``. Returns how many, or -2 when a seq already holds
#: another event; an event already there byte for byte counts as appended (a retried flush).
_XADD_EVENTS = """
local function xadd_events(stream, maxlen, first, last)
  local n = 0
  for j = first, last, 2 do
    local id = (tonumber(ARGV[j]) + 1) .. '-0'
    local ok = redis.pcall('XADD', stream, 'MAXLEN', '~', maxlen, id, 'e', ARGV[j + 1])
    if type(ok) == 'table' and ok.err then
      local held = redis.call('XRANGE', stream, id, id)
      if #held == 0 or held[1][2][2] ~= ARGV[j + 1] then return -2 end
    end
    n = n + 1
  end
  return n
end
"""

#: KEYS: stream, fence. ARGV: attempt, maxlen, ttl_s, seq1, event1, ..., seqN, eventN.
#: Appends events with explicit ids ``<seq+1>-0``. Returns the number appended, -1 when a
#: newer attempt holds the fence (this writer is stale), -2 when a seq already holds another
#: event. An event already in the stream byte for byte counts as appended: a flush retried
#: after a lost answer (on a cluster, a flush that failed on one node only) sends it again.
APPEND = _XADD_EVENTS + """
local fence = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[1]) < fence then return -1 end
local n = xadd_events(KEYS[1], ARGV[2], 4, #ARGV)
if n < 0 then return n end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return n
"""

#: KEYS: stream_1, fence_1, ..., stream_n, fence_n (two per request).
#: ARGV: maxlen, ttl_s, worker (JSON string), num_edges, channel_1 .. channel_m, then per request
#: in KEYS order: edge_index, attempt, num_events, seq_1, event_1, ..., seq_k, event_k.
#: One engine step in one round trip on a single Redis: appends each request's events (fenced
#: by attempt, explicit ids ``<seq+1>-0``, as APPEND) and publishes per edge one ``TokenBatch``
#: (``[worker,[event,...]]``) built from the same encoded events (one already in the stream byte for
#: byte is appended and published again: edges drop seqs they have). Returns {appended_1 .. appended_n,
#: receivers_1 .. receivers_m}; appended -1 (stale) or -2 (seq taken) publishes nothing for it.
#: Its keys span hash slots, so a Redis Cluster takes APPEND (per request) then PUBLISH instead.
APPEND_PUBLISH = _XADD_EVENTS + """
local maxlen, ttl, worker, num_edges = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local batches = {}
for e = 1, num_edges do batches[e] = {} end
local out = {}
local a = 5 + num_edges
for i = 1, #KEYS / 2 do
  local stream, fence = KEYS[2 * i - 1], KEYS[2 * i]
  local edge, attempt, n = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local first = a + 3
  a = first + 2 * n
  local result = 0
  if attempt < tonumber(redis.call('GET', fence) or '0') then
    result = -1
  else
    result = xadd_events(stream, maxlen, first, first + 2 * n - 1)
    if result > 0 then
      redis.call('EXPIRE', stream, ttl)
      local batch = batches[edge]
      for j = first, first + 2 * result - 1, 2 do batch[#batch + 1] = ARGV[j + 1] end
    end
  end
  out[i] = result
end
for e = 1, num_edges do
  local receivers = 0
  if #batches[e] > 0 then
    receivers = redis.call('PUBLISH', ARGV[4 + e], '[' .. worker .. ',[' .. table.concat(batches[e], ',') .. ']]')
  end
  out[#out + 1] = receivers
end
return out
"""

#: KEYS: fence, stream. ARGV: attempt, ttl_s. Raises the fence to ``attempt`` (never lowers it).
FENCE = """
local cur = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) > cur then redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) end
return math.max(cur, tonumber(ARGV[1]))
"""

#: KEYS: req. ARGV: edge, owner. Re-points a request's token delivery to another edge
#: (resume), only for the API key that submitted it. Returns {state, previous edge}, false
#: if the request is gone, {'forbidden', ''} for another key.
REPOINT = """
local h = redis.call('HMGET', KEYS[1], 'state', 'owner', 'edge')
if not h[1] then return false end
if (h[2] or '') ~= ARGV[2] then return {'forbidden', ''} end
redis.call('HSET', KEYS[1], 'edge', ARGV[1])
return {h[1], h[3] or ''}
"""

#: KEYS: req, watch, pending:short, pending:medium, pending:long.
#: ARGV: id, attempt, start_timeout_ms, finished_ttl_s, lane, preempted.
#: A worker hands back a request it holds but will not finish (shutdown, engine death,
#: preemption): it goes back at its original place in ``lane`` (empty: the lane it came from)
#: at once; ``preempted`` = 1 counts one more preemption. Returns 'requeued', 'dropped' (it
#: was cancelled meanwhile) or 'not_owner'.
RELEASE = _NOW + """
local h = redis.call('HMGET', KEYS[1], 'state', 'attempt', 'lane', 'enq_ms')
if h[2] ~= ARGV[2] or (h[1] ~= 'running' and h[1] ~= 'cancelled') then return 'not_owner' end
if h[1] == 'cancelled' then
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  return 'dropped'
end
local lanes = {short = KEYS[3], medium = KEYS[4], long = KEYS[5]}
local lane = ARGV[5] ~= '' and ARGV[5] or h[3]
redis.call('HSET', KEYS[1], 'state', 'queued', 'worker', '', 'lane', lane, 'ready_ms', now)
if ARGV[6] == '1' then redis.call('HINCRBY', KEYS[1], 'preempted', 1) end
redis.call('ZADD', lanes[lane] or KEYS[4], h[4], ARGV[1])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
return 'requeued'
"""

#: KEYS: grants. ARGV: limit, window_ms. One more hand-back in this pool's window if fewer
#: than ``limit`` were granted in it: 1, else 0. Workers decide from the same depth snapshot, so
#: without it one waiting request made every worker hand a run back.
PREEMPT_GRANT = """
local n = redis.call('INCR', KEYS[1])
if n == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if n <= tonumber(ARGV[1]) then return 1 end
return 0
"""

#: KEYS: bucket. ARGV: rate_per_s, burst. A token bucket shared by every edge (fleet-wide
#: per-key rate limit): the same arithmetic as ``ws_server/ratelimit.take_token``, on the
#: Redis clock. Returns 0 when a token was taken, else the wait in ms until one is back.
TAKE_TOKEN = _NOW + """
local rate, cap = tonumber(ARGV[1]), math.max(1, tonumber(ARGV[2]))
local h = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens, at = tonumber(h[1]) or cap, tonumber(h[2]) or now
tokens = math.min(cap, tokens + math.max(0, now - at) * rate / 1000)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = math.ceil((1 - tokens) * 1000 / rate) end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(cap * 1000 / rate) + 1000)
return wait
"""

#: KEYS: req, watch, pending:short, pending:medium, pending:long. ARGV: id, finished_ttl_s.
#: Takes a request whose record is malformed (``records.record_fault``) out of every lane and
#: the reaper's watch, and marks it failed where its record is a hash. Returns {edge, attempt}
#: as far as the record says ('' and 0 where it cannot).
QUARANTINE = """
for i = 2, 5 do redis.call('ZREM', KEYS[i], ARGV[1]) end
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then return {'', 0} end
local h = redis.call('HMGET', KEYS[1], 'edge', 'attempt')
redis.call('HSET', KEYS[1], 'state', 'failed')
redis.call('EXPIRE', KEYS[1], ARGV[2])
return {h[1] or '', math.floor(tonumber(h[2] or '0') or 0)}
"""
