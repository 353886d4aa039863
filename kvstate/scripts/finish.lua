-- finish.lua: a sender finished moving its pages. Sender -> Success; for each
-- receiver still waiting, add this sender to its acks and flip it to Success when
-- every required sender has acked (a receiver that does not know yet how many it
-- needs, peers 0, cannot be flipped). A Failed or missing sender acks nothing; a
-- missing receiver (cleared) gets no acks set (no resurrection). Idempotent.
-- KEYS[1] sender participant hash
-- KEYS[2] room parts hash (TTL refreshed with the participants')
-- KEYS[2j+1], KEYS[2j+2] (j = 1..m) receiver j's participant hash, its acks set
-- ARGV[1] ttl in ms
-- ARGV[2] sender engine (the member added to each acks set)
-- KEYS[#KEYS], ARGV[#ARGV] (last) the room's trace list, the trace TTL (take_trace, _lib.lua)
-- Returns the sender's {status, reason}; status '' means missing.
take_trace()
local tx = KEYS[1]
local ttl = ARGV[1]
local cur = read_status(tx)
if cur[1] == '' or cur[1] == 'Failed' then return cur end
if cur[1] ~= 'Success' then
  set_status(tx, 'Success', now_ms(), ttl, nil)
  trace(tx, 'Success')
end
touch(KEYS[2], ttl)
for j = 1, (#KEYS - 2) / 2 do
  local rx, acks = KEYS[2 * j + 1], KEYS[2 * j + 2]
  local r = redis.call('HMGET', rx, F_STATUS, F_PEERS)
  if r[1] then
    local rank = rank_of(rx, r[1])
    if rank ~= 0 and rank ~= 4 then
      redis.call('SADD', acks, ARGV[2])
      redis.call('PEXPIRE', acks, ttl)
      local peers = number_of(rx, F_PEERS, r[2])
      if peers >= 1 and redis.call('SCARD', acks) >= peers then
        set_status(rx, 'Success', now_ms(), ttl, nil)
        trace(rx, 'Success')
      end
    end
  end
end
return {'Success', ''}
