-- publish.lua: a receiver publishes its transfer info to each sender of the room
-- (receiver -> sender's xfer hash). A sender whose count of infos reaches its
-- required receivers moves Bootstrapping -> WaitingForInput in the same call; the
-- receiver moves to WaitingForInput. Nothing is written for a missing or Failed
-- receiver. A receiver that joins a room whose sender already Failed (aborted before
-- the decode side allocated its pages) fails at once with the sender's reason instead
-- of waiting for acks that can never come.
-- KEYS[1] receiver participant hash
-- KEYS[2] room parts hash (TTL refreshed with the participants')
-- KEYS[2i+1], KEYS[2i+2] (i = 1..n) sender i's participant hash, sender i's xfer hash
-- ARGV[1] ttl in ms
-- ARGV[2] receiver engine (the field name in each xfer hash)
-- ARGV[2+i] msgpack transfer info for sender i
-- Returns the receiver's {status, reason}; status '' means missing.
local rx = KEYS[1]
local ttl = ARGV[1]
local cur = read_status(rx)
if cur[1] == '' or cur[1] == 'Failed' then return cur end
local now = now_ms()
touch(KEYS[2], ttl)
for i = 1, (#KEYS - 2) / 2 do
  local t = redis.call('HMGET', KEYS[2 * i + 1], 'status', 'reason')
  if t[1] == 'Failed' then
    local reason = t[2] or 'sender failed'
    set_status(rx, 'Failed', now, ttl, reason)
    return {'Failed', reason}
  end
end
for i = 1, (#KEYS - 2) / 2 do
  local tx, xfer = KEYS[2 * i + 1], KEYS[2 * i + 2]
  redis.call('HSET', xfer, ARGV[2], ARGV[2 + i])
  redis.call('PEXPIRE', xfer, ttl)
  local t = redis.call('HMGET', tx, 'status', 'peers')
  if t[1] and rank_of(tx, t[1]) == 1 then
    if redis.call('HLEN', xfer) >= number_of(tx, 'peers', t[2]) then
      set_status(tx, 'WaitingForInput', now, ttl, nil)
    end
  end
end
if RANK[cur[1]] < 2 then
  set_status(rx, 'WaitingForInput', now, ttl, nil)
  return {'WaitingForInput', cur[2]}
end
return cur
