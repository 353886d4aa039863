-- create.lua: create one participant (sender or receiver) of a room. The only
-- script that creates a participant; a no-op returning the current status if it
-- already exists (a retried create changes nothing).
-- KEYS[1] participant hash   kvstate:<ns>:{<room>}:<tx|rx>:<engine>
-- KEYS[2] room hash         kvstate:<ns>:{<room>}:room (member -> ''; infos)
-- KEYS[3] room failure mark  kvstate:<ns>:{<room>}:aborted (reason, the failed request's
--         participants), left by every script that fails a participant (abort, timeout,
--         fan-out...) and kept past clear(): a participant created after its room failed
--         starts Failed with it and is named in it, unless its member is named already
--         and no participant is left (all cleared): then the mark goes and the room
--         starts over, a new request under the same room id
-- ARGV[1] ttl in ms
-- ARGV[2] room-hash member (tx:<engine> | rx:<engine>); a sender reads the infos
--         addressed to it there (xfer:<engine>,<receiver>), to start in
--         WaitingForInput when every receiver published before the sender existed;
--         then the infos come back as from poll.lua, so that a sender's first poll is
--         this script alone
-- ARGV[3..] field, value pairs (peers, timeouts unless the default, a receiver's
--           peer address); side and engine are in the key name, not repeated in the hash
-- ARGV[#ARGV], KEYS[#KEYS] (last) the trace TTL; the room's trace list unless that TTL is 0
--         (take_trace, _lib.lua)
-- Returns {status, reason}, or for a new sender in WaitingForInput, or one without a
-- count of its own (peers 0: its receivers declare it, kvstate.tp) that found infos,
-- {status, reason, {field, value, ...}, 0} (poll.lua's answer: infos at version 0).
take_trace()
local key = KEYS[1]
local ttl = ARGV[1]
if redis.call('EXISTS', key) == 1 then return read_status(key) end
local status, reason, infos, peers, was = 'Bootstrapping', nil, nil, nil, nil
local aborted = read_mark(KEYS[3])
if aborted and redis.call('HEXISTS', KEYS[3], ARGV[2]) == 1 and not has_members(KEYS[2]) then
  -- this engine's participant of the failed request cleared, and so did every other
  -- one: a room id used again (SGLang's bootstrap_room) is a new request
  redis.call('DEL', KEYS[3])
  aborted, was = nil, 'Failed'
end
if aborted then  -- a late joiner of the failed request: Failed, and named in the mark
  status, reason = 'Failed', aborted
  redis.call('HSET', KEYS[3], ARGV[2], '')
elseif string.sub(ARGV[2], 1, 3) == 'tx:' then
  for i = 3, #ARGV - 1, 2 do
    if ARGV[i] == F_PEERS then peers = ARGV[i + 1] end
  end
  peers = count_of(key, F_PEERS, peers, 0, MAX_PEERS)
  infos = infos_in(room_call(KEYS[2], 'HGETALL'), string.sub(ARGV[2], 4))
  if peers > 0 and #infos / 2 >= peers then status = 'WaitingForInput' end
end
local now = now_text()
-- one HSET: the given fields, the creation stamp and the status (no since_ms: it
-- equals created_ms until the status changes, and readers fall back to it)
local fields = {F_CREATED_MS, now, F_STATUS, status}
if reason then
  fields[#fields + 1] = F_REASON
  fields[#fields + 1] = reason
end
for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', key, unpack(fields))
redis.call('PEXPIRE', key, ttl)
redis.call('HSET', KEYS[2], ARGV[2], '')  -- the field is the entry: no value to store
redis.call('PEXPIRE', KEYS[2], ttl)
trace(key, F_EV_CREATED, F_STATUS, status, F_REASON, reason, F_TRACE_WAS, was)
if status == 'WaitingForInput' or (peers == 0 and #infos > 0) then
  return {status, '', infos, 0}
end
return {status, reason or ''}
