"""The gateway's Redis scripts, in one place: each runs as one atomic round trip.

Keys (``{p}`` is the deployment prefix, ``{w}`` a worker id, ``{r}`` a replica id):

* ``{p}:pq:{w}`` - a worker's prefill queue: task ids, head first (gateway.state.prefill_queue)
* ``{p}:task:{id}`` - hash: created, enqueued, estimate, ttft_thres, postponed, incremental, owner
* ``{p}:pqcost:{w}`` - estimated seconds of prefill queued (Eq. 1-2's queue term)
* ``{p}:pqtokens:{w}`` - prompt tokens the queued prefills will compute there
* ``{p}:inflight:{w}`` - task ids holding a prefill slot, scored by lease expiry (gateway.state.leases)
* ``{p}:replica:{r}`` and channel ``{p}:ready:{r}`` - a replica's liveness and its dispatch
  notices (gateway.state.replicas)
* ``{p}:session:{scope}:{session}`` - hash: a session's binding and conversation;
  ``{p}:transcript:{scope}:{session}`` - the engine's conversation, JSON, when it differs;
  ``{p}:conversation:{scope}:{hash}`` - the session a conversation belongs to (gateway.state.sessions)
* ``{p}:rounds:{scope}:{session}`` - a session's round records, JSON, oldest first (gateway.state.sessions)
* ``{p}:stat:{series}:{w}`` - hash: the window's running sum and count (``sum``, ``n``), the
  oldest second they hold (``from``), and each second's own (``s{second}``, ``n{second}``)
  until it leaves the window (gateway.state.stats)
* ``{p}:role:{w}`` - hash: role, since, draining of an engine; ``{p}:elastic:leader`` - the
  lease of the replica whose controller moves engines (gateway.state.role_store);
  ``{p}:demand:{interval}`` - hash: rounds arrived with their prefill and context tokens,
  rounds finished with their output tokens, in one controller interval
  (gateway.elastic_live.DemandLog)
"""

from __future__ import annotations

# Enqueue a task; if it is alone in the queue and a slot is free, dispatch it at once
# (any policy's choice over a window of one). KEYS: task, queue, cost, inflight, tokens.
# ARGV: task id, ttl, estimate, max queue, now, slots, lease end, tokens, then the task's
# field/value pairs. Returns -1 (queue full, nothing changed), 1 (queued) or 2 (dispatched).
ENQUEUE = """
if redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[4]) then return -1 end
redis.call('HSET', KEYS[1], unpack(ARGV, 9))
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[5])
if redis.call('LLEN', KEYS[2]) == 0 and redis.call('ZCARD', KEYS[4]) < tonumber(ARGV[6]) then
  redis.call('ZADD', KEYS[4], ARGV[7], ARGV[1])
  return 2
end
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('INCRBYFLOAT', KEYS[3], ARGV[3])
redis.call('INCRBY', KEYS[5], ARGV[8])
return 1
"""

# A task's prefill is over: free its slot and forget it, in one command - every round runs it,
# and redis-py's CPU grows with the commands (a pipeline of the three costs more than this
# script). KEYS: inflight, task, queue. ARGV: task id. Returns the queue's length: tasks
# that may now take the slot.
FREE = """
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
return redis.call('LLEN', KEYS[3])
"""

# Drop lapsed leases, count slots in use, read the head window. KEYS: inflight, queue.
# ARGV: now, window size, task key prefix. Returns busy slots, then (id, fields) pairs.
PEEK = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local busy = redis.call('ZCARD', KEYS[1])
local ids = redis.call('LRANGE', KEYS[2], 0, tonumber(ARGV[2]) - 1)
local out = {busy}
for _, id in ipairs(ids) do
  table.insert(out, id)
  table.insert(out, redis.call('HGETALL', ARGV[3] .. id))
end
return out
"""

# Apply a dispatch decision, if the head window and the free slot it was made on still
# hold. KEYS: inflight, queue, cost, tokens. ARGV: now, slots, lease end, chosen, its estimate,
# task key prefix, window size n, the n window ids as seen, then the new order of the
# rest, then "|" and the ids whose postponement counters go up. Returns 1 (applied),
# 0 (no slot free) or -1 (the window changed).
COMMIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
local n = tonumber(ARGV[7])
local head = redis.call('LRANGE', KEYS[2], 0, n - 1)
if #head ~= n then return -1 end
for i = 1, n do if head[i] ~= ARGV[7 + i] then return -1 end end
redis.call('LTRIM', KEYS[2], n, -1)
local i = 8 + n
local rest = {}
while ARGV[i] ~= '|' do table.insert(rest, ARGV[i]); i = i + 1 end
for j = #rest, 1, -1 do redis.call('LPUSH', KEYS[2], rest[j]) end
for j = i + 1, #ARGV do redis.call('HINCRBY', ARGV[6] .. ARGV[j], 'postponed', 1) end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('INCRBYFLOAT', KEYS[3], -tonumber(ARGV[5]))
redis.call('DECRBY', KEYS[4], tonumber(redis.call('HGET', ARGV[6] .. ARGV[4], 'tokens') or 0))
return 1
"""

# A windowed statistic's running sum and count, moved on to the window of ``width`` seconds that
# starts at second ``first``: the seconds before it are subtracted and dropped. Every write first
# moves the window to its own second, so the seconds held lie in [from, from + width - 1] and a
# move walks at most a window's worth; a move past all of them empties the key. Returns the sum,
# the count and the window's first second (nil for a missing key: an empty window, not created).
# O(1) per read, amortised, where summing a bucket per second cost a window's worth of reads per
# (series, worker).
_WINDOW = """
local function window(key, first, width)
  local head = redis.call('HMGET', key, 'from', 'sum', 'n')
  if not head[1] then return 0, 0, nil end
  local from, total, count = tonumber(head[1]), tonumber(head[2]), tonumber(head[3])
  if from >= first then return total, count, from end
  if first >= from + width then
    redis.call('DEL', key)
    return 0, 0, nil
  end
  local gone = {}
  for s = from, first - 1 do
    local b = redis.call('HMGET', key, 's' .. s, 'n' .. s)
    if b[2] then
      total, count = total - tonumber(b[1]), count - tonumber(b[2])
      table.insert(gone, 's' .. s)
      table.insert(gone, 'n' .. s)
    end
  end
  if count <= 0 then total, count = 0, 0 end
  if #gone > 0 then redis.call('HDEL', key, unpack(gone)) end
  redis.call('HSET', key, 'from', first, 'sum', string.format('%.17g', total), 'n', count)
  return total, count, first
end
"""

# What a round's routing reads, as a Lua function of where its arguments start in ARGV
# (``a``: 0 for SIGNALS, after the session's arguments for OPEN). ARGV from a + 1: key
# prefix, now, n, the n worker ids, stat key prefix, first second, window, then (series,
# worker) pairs. Returns, per worker: seconds of prefill queued (a string: a float), prompt
# tokens queued, prompt tokens of the prefills holding its slots (lapsed leases not
# counted), tasks queued, and rounds in flight on it (the round ledger's unexpired
# entries, gateway.state.round_ledger); then, per pair, the windowed sum (a string) and count.
_SIGNALS = (
    _WINDOW
    + """
local function signals(a)
  local out = {}
  local n = tonumber(ARGV[a + 3])
  for i = a + 4, a + 3 + n do
    local w = ARGV[i]
    table.insert(out, redis.call('GET', ARGV[a + 1] .. ':pqcost:' .. w) or '0')
    table.insert(out, tonumber(redis.call('GET', ARGV[a + 1] .. ':pqtokens:' .. w) or 0))
    local running = 0
    for _, id in ipairs(redis.call('ZRANGEBYSCORE', ARGV[a + 1] .. ':inflight:' .. w, ARGV[a + 2], '+inf')) do
      running = running + tonumber(redis.call('HGET', ARGV[a + 1] .. ':task:' .. id, 'tokens') or 0)
    end
    table.insert(out, running)
    table.insert(out, redis.call('LLEN', ARGV[a + 1] .. ':pq:' .. w))
    table.insert(out, redis.call('ZCOUNT', ARGV[a + 1] .. ':rounds:' .. w, ARGV[a + 2], '+inf'))
  end
  local prefix, first, width = ARGV[a + 4 + n], tonumber(ARGV[a + 5 + n]), tonumber(ARGV[a + 6 + n])
  for i = a + 7 + n, #ARGV, 2 do
    local total, count = window(prefix .. ARGV[i] .. ':' .. ARGV[i + 1], first, width)
    table.insert(out, string.format('%.17g', total))
    table.insert(out, count)
  end
  return out
end
"""
)

# The load signals alone (a server tool round, whose session is in hand; the elastic loop).
SIGNALS = _SIGNALS + "return signals(0)\n"

# Everything a client's round reads before it is planned, in one round trip: its session -
# by the id it gave, else the newest of the conversation keys that names one (gateway.state.sessions)
# - with the session's transcript if it has one, and the load signals. KEYS: the request's
# conversation keys, shortest conversation first (none when it gave an id). ARGV: session key
# prefix, transcript key prefix, the id it gave ('' for none), then SIGNALS's arguments.
# Returns: the session id under each conversation key (nil where none), the id read ('' for
# none), the session's hash (flat; empty if it has none), its transcript (nil if none), the signals.
OPEN = (
    _SIGNALS
    + """
local found = {}
if #KEYS > 0 then found = redis.call('MGET', unpack(KEYS)) end
local id = ARGV[3]
if id == '' then
  for i = #found, 1, -1 do
    if found[i] then id = found[i]; break end
  end
end
local session, transcript = {}, false
if id ~= '' then
  session = redis.call('HGETALL', ARGV[1] .. id)
  for j = 1, #session, 2 do
    if session[j] == 'has_transcript' and session[j + 1] == '1' then transcript = redis.call('GET', ARGV[2] .. id) end
  end
end
return {found, id, session, transcript, signals(3)}
"""
)

# Record a finished round once: a client that retries a request whose stream broke after
# the round was recorded (a gateway replica killed before its last bytes, say) sends
# the same conversation again, and its round replaces the first record instead of
# doubling it. The key is the record's "request" field (gateway.state.sessions.record_round,
# found as json.dumps writes it: a plain search, no JSON decoding per record);
# a retry comes right after the attempt it repeats, so only the newest RECENT records are
# looked at. KEYS: rounds. ARGV: record (JSON), its key, records kept, ttl, RECENT.
# Returns 1 (appended) or 0 (replaced).
RECORD_ROUND = """
local recent = redis.call('LRANGE', KEYS[1], -tonumber(ARGV[5]), -1)
local field = '"request": "' .. ARGV[2] .. '"'
for i = #recent, 1, -1 do
  if string.find(recent[i], field, 1, true) then
    redis.call('LSET', KEYS[1], i - 1 - #recent, ARGV[1])
    redis.call('EXPIRE', KEYS[1], ARGV[4])
    return 0
  end
end
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('LTRIM', KEYS[1], -tonumber(ARGV[3]), -1)
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""

# Save a session after an exchange, in one command instead of five (gateway.state.sessions.save):
# its hash, its transcript (set, or deleted when the engine saw what the client did), its
# place among the active sessions and, for a session without a client-given id, the key it
# is found by from its conversation. KEYS: session, transcript, active[, conversation].
# ARGV: ttl, transcript (JSON, '' for none), active member, its score, session id, then the
# session's field/value pairs.
SAVE_SESSION = """
redis.call('HSET', KEYS[1], unpack(ARGV, 6))
redis.call('EXPIRE', KEYS[1], ARGV[1])
if ARGV[2] ~= '' then
  redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[1])
else
  redis.call('DEL', KEYS[2])
end
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[3])
if KEYS[4] then
  redis.call('SET', KEYS[4], ARGV[5], 'EX', ARGV[1])
end
return 0
"""

# Add a round's observations to their statistics' running windows: one command instead of
# several per observation. Each window is first moved on to the observation's second; an
# observation older than the window a reader has already moved to (a replica whose clock lags)
# is dropped. ARGV: window seconds, ttl, then (key, second, total, count) quadruples.
OBSERVE = (
    _WINDOW
    + """
local width = tonumber(ARGV[1])
for i = 3, #ARGV, 4 do
  local key, second = ARGV[i], tonumber(ARGV[i + 1])
  local _, _, from = window(key, second - width + 1, width)
  if not from then
    from = second - width + 1
    redis.call('HSET', key, 'from', from, 'sum', 0, 'n', 0)
  end
  if second >= from then
    redis.call('HINCRBYFLOAT', key, 's' .. second, ARGV[i + 2])
    redis.call('HINCRBY', key, 'n' .. second, ARGV[i + 3])
    redis.call('HINCRBYFLOAT', key, 'sum', ARGV[i + 2])
    redis.call('HINCRBY', key, 'n', ARGV[i + 3])
    redis.call('EXPIRE', key, ARGV[2])
  end
end
return 0
"""
)

# Take or keep a lease. KEYS: lease. ARGV: holder, ttl in ms. Returns 1 if the holder has it.
LEASE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
