-- publish.lua: a receiver binds to senders and publishes its transfer info to them
-- (receiver -> sender's xfer hash). A receiver binds to the prefill engines of its
-- address as they register (the caller reads the registry), recording each one's
-- incarnation in peer:<engine> the first time; a binding never changes afterwards
-- (a restarted peer fails the room through fan-out instead). The info goes only to
-- senders bound at the incarnation given. A sender whose count of infos reaches its
-- required receivers moves Bootstrapping -> WaitingForInput in the same call and its
-- infos_v is bumped (so its polls fetch infos only when they changed); the receiver
-- moves to WaitingForInput once it has published to `peers` bound senders. Nothing is
-- written for a missing, Failed or Success receiver. A receiver that binds to a sender
-- that already Failed (aborted before the decode side allocated its pages) fails at
-- once with the sender's reason instead of waiting for acks that can never come.
-- KEYS[1] receiver participant hash
-- KEYS[2] room parts hash (TTL refreshed with the participants')
-- KEYS[2i+1], KEYS[2i+2] (i = 1..n) sender i's participant hash, sender i's xfer hash
-- ARGV[1] ttl in ms
-- ARGV[2] receiver engine (the field name in each xfer hash)
-- ARGV[3] msgpack transfer info, or '' to bind only (init() not called yet)
-- ARGV[4] senders required, written if the receiver has none yet (0: not known yet)
-- ARGV[3+2i], ARGV[4+2i] sender i's engine and the incarnation to bind
-- Returns the receiver's {status, reason}; status '' means missing.
local rx = KEYS[1]
local ttl = ARGV[1]
local cur = read_status(rx)
if cur[1] == '' or cur[1] == 'Failed' or cur[1] == 'Success' then return cur end
local n = (#KEYS - 2) / 2
-- (HEXISTS/HGET + HSET rather than HSETNX/HINCRBY: the engine ACL in the README lists
-- the commands kvstate needs, and the script is atomic anyway)
local function bump(key, field)
  redis.call('HSET', key, field, (tonumber(redis.call('HGET', key, field)) or 0) + 1)
end
for i = 1, n do
  local field = F_PEER_PREFIX .. ARGV[3 + 2 * i]
  if redis.call('HEXISTS', rx, field) == 0 then
    redis.call('HSET', rx, field, ARGV[4 + 2 * i])
    bump(rx, F_BOUND)
  end
end
local required = tonumber(ARGV[4])
if required > 0 and number_of(rx, F_PEERS, redis.call('HGET', rx, F_PEERS)) < 1 then
  redis.call('HSET', rx, F_PEERS, required)
end
redis.call('PEXPIRE', rx, ttl)
touch(KEYS[2], ttl)
for i = 1, n do
  local t = redis.call('HMGET', KEYS[2 * i + 1], F_STATUS, F_REASON)
  if t[1] == 'Failed' then
    local reason = t[2] or 'sender failed'
    set_status(rx, 'Failed', now_ms(), ttl, reason)
    return {'Failed', reason}
  end
end
if ARGV[3] == '' then return cur end
for i = 1, n do
  local tx, xfer = KEYS[2 * i + 1], KEYS[2 * i + 2]
  if redis.call('HGET', rx, F_PEER_PREFIX .. ARGV[3 + 2 * i]) == ARGV[4 + 2 * i] then
    redis.call('HSET', xfer, ARGV[2], ARGV[3])
    redis.call('PEXPIRE', xfer, ttl)
    local t = redis.call('HMGET', tx, F_STATUS, F_PEERS)
    if t[1] then
      bump(tx, F_INFOS_V)
      if rank_of(tx, t[1]) == 1 and redis.call('HLEN', xfer) >= number_of(tx, F_PEERS, t[2]) then
        set_status(tx, 'WaitingForInput', now_ms(), ttl, nil)
      end
    end
  end
end
local h = redis.call('HMGET', rx, F_BOUND, F_PEERS)
local bound, peers = tonumber(h[1]) or 0, number_of(rx, F_PEERS, h[2])
if RANK[cur[1]] < 2 and peers >= 1 and bound >= peers then
  set_status(rx, 'WaitingForInput', now_ms(), ttl, nil)
  return {'WaitingForInput', cur[2]}
end
return cur
