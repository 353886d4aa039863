-- fail_bound.lua: dead-peer fan-out for one receiver. Fails it with the reason
-- if it is bound to the peer engine (field peer:<engine>) and, when an
-- incarnation is given, to that incarnation: a peer restarted at the same
-- address with a new incarnation does not fail rooms bound to the new one.
-- Terminal participants are left alone. A receiver it fails sets the room's
-- failure mark, so the other side (a sender that resumes after losing its lease)
-- cannot reach Success (design rule 3).
-- KEYS[1] receiver participant hash
-- KEYS[2] room hash (TTL refreshed with the participant's)
-- KEYS[3] room failure mark
-- ARGV[1] ttl in ms
-- ARGV[2] reason
-- ARGV[3] peer engine, or '' for any peer (every receiver tracked at an address
--         is bound to some engine there)
-- ARGV[4] peer incarnation, or '' for any
-- ARGV[5] the failure mark's ttl in ms
-- ARGV[#ARGV], KEYS[#KEYS] (last) the trace TTL; the room's trace list unless that TTL is 0
--         (take_trace, _lib.lua)
-- Returns 1 if it failed the participant, else 0.
take_trace()
local key = KEYS[1]
local h = redis.call('HMGET', key, F_STATUS, F_PEER_PREFIX .. ARGV[3])
if not h[1] then return 0 end
local rank = rank_of(key, h[1])
if rank == 0 or rank == 4 then return 0 end
if ARGV[3] ~= '' then
  if not h[2] then return 0 end
  if ARGV[4] ~= '' and h[2] ~= ARGV[4] then return 0 end
end
fail_room(key, ARGV[2], ARGV[1], ARGV[5])
return 1
