-- poll.lua: read a participant's status, applying its timeouts on the server
-- clock: stuck in Bootstrapping past bootstrap_timeout_ms, or in WaitingForInput
-- past waiting_timeout_ms, it becomes Failed with a reason naming the timeout (and,
-- for a receiver, how many of its required senders it had bound).
-- KEYS[1] participant hash
-- KEYS[2] room parts hash (TTL refreshed with the participant's)
-- KEYS[3] (optional) transfer infos hash to return with the status once the
--         participant is past Bootstrapping (saves the sender a round trip)
-- ARGV[1] ttl in ms (refreshed only when the poll fails the participant)
-- ARGV[2] (with KEYS[3]) the infos version the caller holds: the infos are returned
--         only when the sender's infos_v (bumped by publish.lua) differs from it
-- KEYS[#KEYS], ARGV[#ARGV] (last) the room's trace list, the trace TTL (take_trace, _lib.lua)
-- Returns {status, reason, {field, value, ...}, version}; status '' means missing;
-- version is -1 when no infos were returned.
take_trace()
local key = KEYS[1]
local h = redis.call('HMGET', key, F_STATUS, F_REASON, F_SINCE_MS,
  F_BOOTSTRAP_TIMEOUT_MS, F_WAITING_TIMEOUT_MS, F_INFOS_V, F_PEER_ADDR, F_BOUND, F_PEERS)
if not h[1] then return {'', 'missing', {}, -1} end
local rank = rank_of(key, h[1])
local status, reason = h[1], h[2] or ''
if rank == 1 or rank == 2 then
  local field, raw = F_WAITING_TIMEOUT_MS, h[5]
  if rank == 1 then field, raw = F_BOOTSTRAP_TIMEOUT_MS, h[4] end
  local limit = number_of(key, field, raw)
  local now = now_ms()
  local waited = now - number_of(key, F_SINCE_MS, h[3])
  if limit > 0 and waited > limit then
    status = 'Failed'
    reason = string.format('%s timeout: %s for %.1f s (limit %.1f s)',
      (rank == 1) and 'bootstrap' or 'waiting', h[1], waited / 1000, limit / 1000)
    if rank == 1 and h[7] then
      local peers = tonumber(h[9]) or 0
      reason = reason .. string.format('; bound %d of %s senders at %s',
        tonumber(h[8]) or 0, (peers > 0) and tostring(peers) or '?', h[7])
    end
    set_status(key, status, now, ARGV[1], reason)
    touch(KEYS[2], ARGV[1])
    trace(key, 'Failed', F_REASON, reason)
  end
end
local infos, version = {}, -1
if KEYS[3] and status ~= 'Failed' and rank >= 2 then
  local have = tonumber(h[6]) or 0
  if tostring(have) ~= ARGV[2] then
    infos, version = redis.call('HGETALL', KEYS[3]), have
  end
end
return {status, reason, infos, version}
