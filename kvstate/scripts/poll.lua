-- poll.lua: read a participant's status, applying its timeouts on the server
-- clock (timeouts_ms: "<bootstrap ms> <waiting ms>", F_DEFAULT_TIMEOUTS_MS when the
-- participant stores none): stuck in Bootstrapping or in
-- WaitingForInput past that status's limit (since_ms, or created_ms before the first
-- status change), it becomes Failed with a reason naming the timeout (and, for a
-- receiver, how many of its required senders it had bound), and the room's failure
-- mark is set. A participant of a room that failed elsewhere (the mark is
-- set: an abort, the other side's timeout or fan-out) becomes Failed with the mark's
-- reason, Success included: at rest, the participants of a room agree (design rule 3).
-- KEYS[1] participant hash
-- KEYS[2] room hash (TTL refreshed with the participant's; the transfer infos)
-- KEYS[3] room failure mark (hash: the first failure's reason, _lib.lua)
-- ARGV[1] ttl in ms (refreshed only when the poll fails the participant)
-- ARGV[2] the infos version the caller holds (with ARGV[4]): the infos are returned
--         only when the sender's infos_v (bumped by publish.lua) differs from it
-- ARGV[3] the failure mark's ttl in ms
-- ARGV[4] (optional) the sender's engine, whose transfer infos (the room hash's
--         xfer:<engine>,<receiver> fields) to return with the status once it is past
--         Bootstrapping (saves the sender a round trip)
-- A sender's bootstrap timeout waits while a decode engine holds the room in its queue
-- (the room hash's F_HOLD, a server time, hold.lua), read only at that timeout.
-- ARGV[5] (optional, with ARGV[4]) the receivers a Bootstrapping sender without a
--         count of its own (peers 0) learned from infos published before it existed
--         (their declared count, kvstate.tp): written into it, and it moves to
--         WaitingForInput when that many infos are there
-- ARGV[6] (optional, with ARGV[5]: 0 when none) begin: the room's receiver key prefix
--         (`...{<room>}:rx:`, completed by a receiver's engine: the room's slot). A
--         sender found WaitingForInput (or moved there by ARGV[5]) is begun in this
--         call, as begin.lua would: Transferring, answered with its infos (exactly the
--         receivers checked, to write to), or Failed when a receiver is gone or Failed
--         (fewer infos than its peers: a receiver cleared). Saves the step a round trip.
-- ARGV[#ARGV], KEYS[#KEYS] (last) the trace TTL; the room's trace list unless that TTL
--         is 0 (take_trace, _lib.lua): after the mark's key and TTL, so ARGV[4] stays
--         optional
-- Returns {status, reason}, or {status, reason, {field, value, ...}, version} when it
-- returns infos; status '' means missing. (No empty table and -1 placeholder: each
-- table in a reply costs Redis CPU to convert, and a poll is the most frequent call.)
take_trace()
local key = KEYS[1]
-- what every poll may need; the binding fields a timeout's reason names are read
-- only at that timeout (each field read costs Redis CPU, and polls are most calls)
local h = redis.call('HMGET', key, F_STATUS, F_REASON, F_SINCE_MS,
  F_TIMEOUTS_MS, F_INFOS_V, F_CREATED_MS)
if not h[1] then return {'', 'missing'} end
local rank = rank_of(key, h[1])
local status, reason = h[1], h[2] or ''
if rank == 0 then return {status, reason} end
-- everything read and checked before anything is written (design rule 7)
local mark = read_mark(KEYS[3])
local timed_out = nil
if not mark and (rank == 1 or rank == 2) then
  local timeouts = h[4] or F_DEFAULT_TIMEOUTS_MS
  local bootstrap, waiting = string.match(timeouts, '^(%d+) (%d+)$')
  if not bootstrap then corrupt(key, F_TIMEOUTS_MS, h[4]) end
  bootstrap = count_of(key, F_TIMEOUTS_MS, bootstrap, 0, MAX_TIMEOUT_MS)
  waiting = count_of(key, F_TIMEOUTS_MS, waiting, 0, MAX_TIMEOUT_MS)
  local limit = (rank == 1) and bootstrap or waiting
  -- since_ms is written at the first status change; until then it is created_ms
  local waited = now_ms() - time_of(key, h[3] and F_SINCE_MS or F_CREATED_MS, h[3] or h[6])
  if limit > 0 and waited > limit and rank == 1 and string.find(key, '}:tx:', 1, true) then
    -- a decode holding the room in its queue (hold.lua): the sender waits for it; a
    -- hold that is no server time up to the largest timeout from now is corrupt
    local held = room_call(KEYS[2], 'HGET', F_HOLD)
    if held and count_of(KEYS[2], F_HOLD, held, 0, now_ms() + MAX_TIMEOUT_MS) > now_ms() then
      limit = 0
    end
  end
  if limit > 0 and waited > limit then
    timed_out = string.format('%s timeout: %s for %.1f s (limit %.1f s)',
      (rank == 1) and 'bootstrap' or 'waiting', h[1], waited / 1000, limit / 1000)
    local b = (rank == 1) and redis.call('HMGET', key, F_PEER_ADDR, F_BOUND, F_PEERS) or {}
    if b[1] then  -- a receiver: how far its binding got
      local peers = count_of(key, F_PEERS, b[3] or '0', 0, MAX_PEERS)
      -- bound is stored only while it differs from peers (publish.lua)
      local bound = count_of(key, b[2] and F_BOUND or F_PEERS, b[2] or b[3] or '0', 0, MAX_PEERS)
      b[1] = string.sub(b[1], 1, 200)  -- an address, named in the reason
      timed_out = timed_out .. string.format('; bound %d of %s senders at %s',
        bound, (peers > 0) and tostring(peers) or '?', b[1])
      if bound >= peers and peers > 0 then
        timed_out = timed_out .. ' (bound, but init() was never called: nothing published)'
      end
    end
  end
end
if mark or timed_out then
  status, reason = 'Failed', mark or timed_out
  set_status(key, status, now_text(), ARGV[1], reason)
  touch(KEYS[2], ARGV[1])
  if timed_out then mark_room(KEYS[3], KEYS[2], reason, ARGV[3]) end
  trace(key, 'Failed', F_REASON, reason)
  return {status, reason}
end
local infos, moved = nil, false  -- moved: to WaitingForInput in this call (ARGV[5])
if ARGV[5] and rank == 1 then
  local declared = tonumber(ARGV[5]) or 0
  local own = count_of(key, F_PEERS, redis.call('HGET', key, F_PEERS), 0, MAX_PEERS)
  if own == 0 and declared > 0 then
    infos = infos_in(room_call(KEYS[2], 'HGETALL'), ARGV[4])
    moved = #infos / 2 >= declared
    if not moved then
      redis.call('HSET', key, F_PEERS, declared)
      return {status, reason}
    end
  end
end
local have = h[5] or '0'
if ARGV[4] and (rank >= 2 or moved) then count_of(key, F_INFOS_V, have, 0, MAX_COUNT) end
-- begin (ARGV[6]): a sender ready to write is begun here, as begin.lua would begin it
-- with the receivers whose infos it is answered (all of them are returned then)
local begin = ARGV[6] and ARGV[6] ~= '' and (rank == 2 or moved)
local why = nil
if begin then
  infos = infos or infos_in(room_call(KEYS[2], 'HGETALL'), ARGV[4])
  for i = 1, #infos, 2 do  -- every receiver read: a corrupt one raises before any write
    local refuses = receiver_refuses(ARGV[6] .. infos[i], infos[i])
    why = why or refuses
  end
  local peers = moved and tonumber(ARGV[5])
    or count_of(key, F_PEERS, redis.call('HGET', key, F_PEERS) or '0', 0, MAX_PEERS)
  if not why and #infos / 2 < peers then  -- a receiver cleared: its info went with it
    why = string.format('%d of the %d receivers are gone (cleared) before the transfer',
      peers - #infos / 2, peers)
  end
end
if moved then
  redis.call('HSET', key, F_PEERS, ARGV[5])
  set_status(key, 'WaitingForInput', now_text(), ARGV[1])
  touch(KEYS[2], ARGV[1])
  trace(key, 'WaitingForInput')
  status = 'WaitingForInput'
end
if why then return fail_room(key, why, ARGV[1], ARGV[3]) end
if begin then
  set_status(key, 'Transferring', now_text(), ARGV[1], nil)
  touch(KEYS[2], ARGV[1])
  trace(key, 'Transferring')
  return {'Transferring', reason, infos, have}
end
if ARGV[4] and (rank >= 2 or moved) and (moved or have ~= ARGV[2]) then
  return {status, reason, infos or infos_in(room_call(KEYS[2], 'HGETALL'), ARGV[4]), have}
end
return {status, reason}
