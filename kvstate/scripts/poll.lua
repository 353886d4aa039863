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
if ARGV[5] and rank == 1 then
  local declared = tonumber(ARGV[5]) or 0
  local own = count_of(key, F_PEERS, redis.call('HGET', key, F_PEERS), 0, MAX_PEERS)
  if own == 0 and declared > 0 then
    local infos = infos_in(room_call(KEYS[2], 'HGETALL'), ARGV[4])
    if #infos / 2 >= declared then
      local version = count_of(key, F_INFOS_V, h[5] or '0', 0, MAX_COUNT)  -- before writes
      redis.call('HSET', key, F_PEERS, declared)
      set_status(key, 'WaitingForInput', now_text(), ARGV[1])
      touch(KEYS[2], ARGV[1])
      trace(key, 'WaitingForInput')
      return {'WaitingForInput', reason, infos, version}
    end
    redis.call('HSET', key, F_PEERS, declared)
  end
end
if ARGV[4] and rank >= 2 then
  local have = h[5] or '0'
  count_of(key, F_INFOS_V, have, 0, MAX_COUNT)
  if have ~= ARGV[2] then
    return {status, reason, infos_in(room_call(KEYS[2], 'HGETALL'), ARGV[4]), have}
  end
end
return {status, reason}
