-- publish.lua: a receiver binds to senders and publishes its transfer info to them
-- (the room hash's field xfer:<sender>,<receiver>). A receiver binds to the prefill
-- engines of its address as they register (the caller reads the registry, or the script: lookup,
-- below), recording each one's incarnation in peer:<engine> the first time; a
-- binding never changes afterwards (a restarted peer fails the room through fan-out
-- instead). The info goes only to senders bound at the incarnation given. A sender
-- whose count of infos reaches its required receivers moves Bootstrapping ->
-- WaitingForInput in the same call and its infos_v is bumped (so its polls fetch
-- infos only when they changed); the receiver moves to WaitingForInput once it has
-- published to `peers` bound senders. Nothing is written for a missing, Failed or
-- Success receiver. A receiver that binds to a sender that already Failed (aborted
-- before the decode side allocated its pages) fails at once with the sender's reason
-- instead of waiting for acks that can never come. A receiver in a room that failed
-- (its failure mark is set) fails with the mark's reason. Everything is read and
-- checked before anything is written (design rule 7).
-- KEYS[1] receiver participant hash
-- KEYS[2] room hash (TTL refreshed with the participants'; the transfer infos)
-- KEYS[3] room failure mark
-- A sender created without a count of its own (peers 0: tensor parallelism of another
-- size on the decode side, kvstate.tp) waits for as many receivers as they declare
-- (ARGV[7]); the first info that declares it writes it into the sender, and a count
-- that disagrees with the sender's fails the room with the reason.
-- KEYS[1] receiver participant hash
-- KEYS[2] room hash (TTL refreshed with the participants'; the transfer infos)
-- KEYS[3] room failure mark
-- Either the caller names the senders (KEYS/ARGV below: senders=[...], a Cluster,
-- whose index lives in another slot; ARGV[6] is ''), or (lookup, standalone only:
-- ARGV[6] is the room's sender key prefix) the script finds them itself in the address's engine index, the registry
-- read folded into this call (issue 22): the live prefill engines listed there (lease
-- deadline after now, the latest incarnation of each name), those not bound yet, in
-- name order, up to the senders still required; when none is required yet, as many
-- as the group declares (its largest `ranks`) or as are listed, whichever is more.
-- A lookup names the chosen senders' keys from the room's prefix it is given
-- (ARGV[6]): the same slot as KEYS[1], the one exception to "only KEYS".
-- KEYS[3+i] (i = 1..n) sender i's participant hash
-- KEYS[4] (lookup) the index  kvstate:<ns>:engines_at:<bootstrap addr> (index.lua)
-- ARGV[1] ttl in ms
-- ARGV[2] receiver engine (in each xfer:<sender>,<receiver> field)
-- ARGV[3] msgpack transfer info, or '' to bind only (init() not called yet)
-- ARGV[4] senders required, written if the receiver has none yet (0: not known yet)
-- ARGV[5] the failure mark's ttl in ms
-- ARGV[6] '' (senders named), or (lookup) the room's sender key prefix
--         (`...{<room>}:tx:`), completed by a sender's engine
-- ARGV[7] receivers each sender waits for, as the receivers declare it (0: none declared)
-- ARGV[5+3i], ARGV[6+3i], ARGV[7+3i] (named) sender i's engine, the incarnation to bind,
--         and the info for that sender ('': ARGV[3]; tensor parallelism of another size
--         sends each sender its own heads)
-- ARGV[8] (lookup) k: how many senders the receiver names (0: any listed at the address)
-- ARGV[7+2i], ARGV[8+2i] (lookup, i = 1..k) named sender i's engine and its own info
--         ('': ARGV[3]): only the named listed at the address are bound (issue 33: the
--         registry read a named binding made before its publish, folded in)
-- ARGV[9+2k..] (lookup) the senders the caller knows it is bound to: not published to here
-- ARGV[#ARGV], KEYS[#KEYS] (last) the trace TTL; the room's trace list unless that TTL
--         is 0 (take_trace, _lib.lua): after the senders, taken off first, so the lists
--         above hold
-- Returns the receiver's {status, reason}; status '' means missing. A lookup that
-- bound or found bound returns {status, reason, {engine, incarnation, ...} of the
-- listed senders the receiver is bound to after it, the senders required}.
take_trace()
local rx = KEYS[1]
local ttl = ARGV[1]
local lookup = ARGV[6] ~= ''
local names, incs, txk, pays = {}, {}, {}, {}  -- sender i: engine, incarnation, key, info
local most = 0  -- lookup: the largest group size (`ranks`) declared by those listed
local named = {}  -- lookup: the senders named (engine -> own info), if any
local k = lookup and tonumber(ARGV[8]) or 0
for i = 1, k do named[ARGV[7 + 2 * i]] = ARGV[8 + 2 * i] end
if lookup then
  local inc_of = {}
  -- members only, no scores: BYSCORE lists them in deadline order already
  local listed = redis.pcall('ZRANGE', KEYS[4], '(' .. now_text(), '+inf', 'BYSCORE')
  if listed.err then corrupt(KEYS[4], '*', 'not a sorted set') end
  for i = 1, #listed do
    local e, inc, ranks, role = string.match(listed[i], '^(%S+) (%S+) (%d+) (%S+)$')
    -- a member of any other shape, or a group larger than MAX_PEERS, is none of
    -- kvstate's (kvstate.registry.parse_member skips the same ones)
    if e and role == 'prefill' and #ranks <= 6 and tonumber(ranks) <= MAX_PEERS
      and (k == 0 or named[e]) then
      if inc_of[e] == nil then names[#names + 1] = e end
      inc_of[e] = inc  -- listed by deadline: the last of a name is its latest incarnation
      most = math.max(most, tonumber(ranks))
    end
  end
  table.sort(names)
  for i, e in ipairs(names) do incs[i] = inc_of[e] end
else
  for i = 1, #KEYS - 3 do
    names[i], incs[i], txk[i] = ARGV[5 + 3 * i], ARGV[6 + 3 * i], KEYS[3 + i]
    pays[i] = ARGV[7 + 3 * i]
  end
end
-- Everything read of the receiver, in one HMGET; everything written to it, in one HSET
-- at the end. (HSET of read values rather than HSETNX/HINCRBY: the engine ACL in
-- docs/security.md lists the commands kvstate needs, and the script is atomic anyway.)
local want = {F_STATUS, F_REASON, F_BOUND, F_PEERS, F_CREATED_MS, F_SINCE_MS}
for i = 1, #names do want[6 + i] = F_PEER_PREFIX .. names[i] end
local h = redis.call('HMGET', rx, unpack(want))
if not h[1] then return {'', 'missing'} end
rank_of(rx, h[1])
local cur = {h[1], h[2] or ''}
if cur[1] == 'Failed' or cur[1] == 'Success' then return cur end
local writes = {}
local function put(field, value)
  writes[#writes + 1] = field
  writes[#writes + 1] = value
end
-- bound is stored only while it differs from peers: missing, it is peers (issue 33)
local bound = count_of(rx, h[3] and F_BOUND or F_PEERS, h[3] or h[4] or '0', 0, MAX_PEERS)
local required = tonumber(ARGV[4])
local answered = {}  -- lookup: engine, incarnation of each listed sender bound after it
if lookup then
  -- those listed and not bound yet, in name order, up to the senders still required
  if required == 0 and #names > 0 then required = math.max(#names, most) end
  local known = {}
  for i = 9 + 2 * k, #ARGV do known[ARGV[i]] = true end
  local kept, kinc, kheld, more = {}, {}, {}, 0
  for i = 1, #names do
    local take = false
    if h[6 + i] then
      -- bound before: answered, and published to unless the caller knows it (then it
      -- publishes itself), so a caller whose earlier binding went unanswered catches up
      answered[#answered + 1] = names[i]
      answered[#answered + 1] = h[6 + i]
      take = not known[names[i]]
    elseif more < required - bound then
      take, more = true, more + 1
    end
    if take then
      kept[#kept + 1] = names[i]
      kinc[#kept], kheld[#kept] = incs[i], h[6 + i]
    end
  end
  names, incs = kept, kinc
  for i, e in ipairs(names) do
    h[6 + i] = kheld[i]
    want[6 + i] = F_PEER_PREFIX .. e
    txk[i] = ARGV[6] .. e
    pays[i] = named[e]
  end
end
local n = #names
local held = {}  -- the incarnation each sender is bound at, after this call
local newly = {}  -- senders bound by this call, traced once every read is done
for i = 1, n do
  held[i] = h[6 + i]
  if not held[i] then
    held[i] = incs[i]
    put(want[6 + i], held[i])
    bound = bound + 1
    newly[#newly + 1] = i
    answered[#answered + 1] = names[i]
    answered[#answered + 1] = incs[i]
  end
end
-- the answer: a lookup's carries whom it bound, and the senders required
local function answer(st)
  if lookup then return {st[1], st[2], answered, required} end
  return st
end
local peers = count_of(rx, F_PEERS, h[4], 0, MAX_PEERS)
if required > 0 and peers < 1 then
  peers = required
  put(F_PEERS, required)
end
-- bound: written while it differs from peers, dropped once equal (missing: peers)
local drop_bound = h[3] and bound == peers
if bound ~= peers and (not h[3] or tonumber(h[3]) ~= bound) then put(F_BOUND, bound) end
-- the bindings' trace entries, once, after the reads that can fail (a corrupt or
-- mistyped key raises, and must leave nothing written: design rule 7)
local function trace_bound()
  for _, i in ipairs(newly) do
    trace(rx, F_EV_BOUND, F_TRACE_PEER, names[i], F_INCARNATION, held[i])
  end
  newly = {}
end
-- the receiver's writes, TTLs refreshed; `status`: a new status to record with them
local function finish_rx(status, reason)
  trace_bound()
  if status then
    put(F_STATUS, status)
    -- since_ms is left out while it would be created_ms (the first status change in
    -- the creation's millisecond): readers take created_ms then (issue 33)
    local now = now_text()
    if h[6] or now ~= h[5] then put(F_SINCE_MS, now) end
    if reason then put(F_REASON, reason) end
  end
  if #writes > 0 then redis.call('HSET', rx, unpack(writes)) end
  if drop_bound then
    redis.call('HDEL', rx, F_BOUND)
    drop_bound = false
  end
  redis.call('PEXPIRE', rx, ttl)
  touch(KEYS[2], ttl)
end
-- the senders, read and checked before any write: their status and peers, and how
-- many receivers each waits for (its own count, else the one its receivers declare)
local senders, why = {}, read_mark(KEYS[3])
local counting = false  -- a Bootstrapping sender: whether this info makes it ready
local want = tonumber(ARGV[7]) or 0
for i = 1, n do
  local tx = txk[i]
  local t = redis.call('HMGET', tx, F_STATUS, F_REASON, F_PEERS, F_INFOS_V)
  if t[1] then
    rank_of(tx, t[1])
    local own = count_of(tx, F_PEERS, t[3], 0, MAX_PEERS)
    t[7] = (own > 0) and own or want
    t[4] = count_of(tx, F_INFOS_V, t[4] or '0', 0, MAX_COUNT)
    if t[1] == 'Failed' then why = why or t[2] or 'sender failed' end
    if own == 0 and want == 0 and ARGV[3] ~= '' then
      why = why or string.format('sender %s waits for its receivers to declare how many '
        .. 'they are, and receiver %s declared none: run one kvstate release and one '
        .. 'integration on both sides', names[i], ARGV[2])
    elseif own > 0 and want > 0 and own ~= want then
      why = why or string.format('receiver %s declares %d receivers for sender %s, '
        .. 'which serves %d: the two sides disagree on the parallel layout (TP sizes, '
        .. 'KV heads)', ARGV[2], want, names[i], own)
    end
    t[8] = (own == 0) and want > 0  -- the sender learns its count from this info
    if t[1] == 'Bootstrapping' then counting = true end
  end
  senders[i] = t
end
-- the infos each sender holds in the room hash (t[5], and t[6] = 1 if one is this
-- receiver's), read only when a Bootstrapping sender needs the count. The read also
-- checks the room hash's type before any write (a key of the wrong type raises here,
-- nothing written); where it is left out (one command less), the call publishes
-- untraced, and its first write, the room hash's in the loop below, is that check.
local first_write_checks = not (counting or why or ARGV[3] == '' or trace_ttl ~= 0)
if n > 0 and not first_write_checks then
  local fields = room_call(KEYS[2], 'HKEYS')
  for i = 1, n do
    local prefix = F_XFER_PREFIX .. names[i] .. F_SEP
    local count, mine = 0, 0
    for _, f in ipairs(fields) do
      if string.sub(f, 1, #prefix) == prefix then
        count = count + 1
        if f == prefix .. ARGV[2] then mine = 1 end
      end
    end
    senders[i][5], senders[i][6] = count, mine
  end
end
if why then
  finish_rx('Failed', why)
  mark_room(KEYS[3], KEYS[2], why, ARGV[5])
  trace(rx, 'Failed', F_REASON, why)
  return answer({'Failed', why})
end
if ARGV[3] == '' then
  finish_rx(nil, nil)
  return answer(cur)
end
trace_bound()
for i = 1, n do
  local tx = txk[i]
  if held[i] == incs[i] then
    -- the room hash's TTL: refreshed by finish_rx() below, after these writes
    local field = F_XFER_PREFIX .. names[i] .. F_SEP .. ARGV[2]
    local info = (pays[i] and pays[i] ~= '') and pays[i] or ARGV[3]
    room_call(KEYS[2], 'HSET', field, info)  -- only the first can fail: nothing written yet
    trace(rx, F_EV_PUBLISHED, F_TRACE_PEER, names[i])
    local t = senders[i]
    if t[1] then
      local fields = {F_INFOS_V, t[4] + 1}
      if t[8] then
        fields[#fields + 1] = F_PEERS
        fields[#fields + 1] = t[7]
      end
      local ready = t[1] == 'Bootstrapping' and t[5] + 1 - t[6] >= t[7]
      if ready then
        fields[#fields + 1] = F_STATUS
        fields[#fields + 1] = 'WaitingForInput'
        fields[#fields + 1] = F_SINCE_MS
        fields[#fields + 1] = now_text()
      end
      redis.call('HSET', tx, unpack(fields))
      notify(tx)  -- its next poll reads new infos: its engine's step polls it
      if ready then
        redis.call('PEXPIRE', tx, ttl)
        trace(tx, 'WaitingForInput')
      end
    end
  end
end
if RANK[cur[1]] < 2 and peers >= 1 and bound >= peers then
  finish_rx('WaitingForInput', nil)
  trace(rx, 'WaitingForInput')
  return answer({'WaitingForInput', cur[2]})
end
finish_rx(nil, nil)
return answer(cur)
