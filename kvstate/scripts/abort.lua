-- abort.lua: fail every participant of a room with a reason, Success included
-- (the explicit abort of SPEC rule 3). The caller read the parts set first; if it
-- changed since (a participant joined or cleared), nothing is written and -1 is
-- returned so the caller reads it again.
-- KEYS[1] room parts hash
-- KEYS[1+i] (i = 1..n) participant hash of parts member i
-- ARGV[1] ttl in ms
-- ARGV[2] reason
-- ARGV[2+i] parts member i, as the caller read it
-- Returns the number of participants moved to Failed, or -1.
local parts = KEYS[1]
local n = #KEYS - 1
if redis.call('HLEN', parts) ~= n then return -1 end
for i = 1, n do
  if redis.call('HEXISTS', parts, ARGV[2 + i]) == 0 then return -1 end
end
local now = now_ms()
local failed = 0
for i = 1, n do
  local key = KEYS[1 + i]
  local cur = read_status(key)
  if cur[1] ~= '' and cur[1] ~= 'Failed' then
    set_status(key, 'Failed', now, ARGV[1], ARGV[2])
    failed = failed + 1
  end
end
if failed > 0 then touch(parts, ARGV[1]) end
return failed
