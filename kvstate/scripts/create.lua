-- create.lua: create one participant (sender or receiver) of a room. The only
-- script that creates a participant; a no-op returning the current status if it
-- already exists (a retried create changes nothing).
-- KEYS[1] participant hash   kvstate:<ns>:{<room>}:<tx|rx>:<engine>
-- KEYS[2] room parts hash    kvstate:<ns>:{<room>}:parts (member -> created ms)
-- KEYS[3] room abort mark    kvstate:<ns>:{<room>}:aborted (reason), left by abort.lua:
--         a participant created after an abort of its room starts Failed with it
-- KEYS[4] (sender only) the sender's transfer infos hash, to start in
--         WaitingForInput when every receiver published before the sender existed
-- ARGV[1] ttl in ms
-- ARGV[2] parts member (tx:<engine> | rx:<engine>)
-- ARGV[3..] field, value pairs (addr, peers, timeouts, peer bindings); side and
--           engine are in the key name, not repeated in the hash
-- Returns {status, reason}.
local key = KEYS[1]
local ttl = ARGV[1]
if redis.call('EXISTS', key) == 1 then return read_status(key) end
local now = now_ms()
local fields = {}
for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', key, 'created_ms', now, unpack(fields))
local status, reason = 'Bootstrapping', nil
local aborted = redis.call('GET', KEYS[3])
if aborted then
  status, reason = 'Failed', aborted
elseif KEYS[4] then
  local peers = number_of(key, 'peers', redis.call('HGET', key, 'peers'))
  if redis.call('HLEN', KEYS[4]) >= peers then status = 'WaitingForInput' end
end
set_status(key, status, now, ttl, reason)
redis.call('HSET', KEYS[2], ARGV[2], now)
redis.call('PEXPIRE', KEYS[2], ttl)
return {status, reason or ''}
