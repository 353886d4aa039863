-- poll.lua: read a participant's status, applying its timeouts on the server
-- clock: stuck in Bootstrapping past bootstrap_timeout_ms, or in WaitingForInput
-- past waiting_timeout_ms, it becomes Failed with a reason naming the timeout.
-- KEYS[1] participant hash
-- KEYS[2] room parts hash (TTL refreshed with the participant's)
-- KEYS[3] (optional) transfer infos hash to return with the status once the
--         participant is past Bootstrapping (saves the sender a round trip)
-- ARGV[1] ttl in ms (refreshed only when the poll fails the participant)
-- Returns {status, reason, {field, value, ...}}; status '' means missing.
local key = KEYS[1]
local h = redis.call('HMGET', key, 'status', 'reason', 'since_ms',
  'bootstrap_timeout_ms', 'waiting_timeout_ms')
if not h[1] then return {'', 'missing', {}} end
local rank = rank_of(key, h[1])
local status, reason = h[1], h[2] or ''
if rank == 1 or rank == 2 then
  local field, raw = 'waiting_timeout_ms', h[5]
  if rank == 1 then field, raw = 'bootstrap_timeout_ms', h[4] end
  local limit = number_of(key, field, raw)
  local now = now_ms()
  local waited = now - number_of(key, 'since_ms', h[3])
  if limit > 0 and waited > limit then
    status = 'Failed'
    reason = string.format('%s timeout: %s for %.1f s (limit %.1f s)',
      (rank == 1) and 'bootstrap' or 'waiting', h[1], waited / 1000, limit / 1000)
    set_status(key, status, now, ARGV[1], reason)
    touch(KEYS[2], ARGV[1])
  end
end
local infos = {}
if KEYS[3] and status ~= 'Failed' and rank >= 2 then
  infos = redis.call('HGETALL', KEYS[3])
end
return {status, reason, infos}
