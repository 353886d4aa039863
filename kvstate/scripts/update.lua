-- update.lua: move one participant's status by the merge rule (design rule 3):
-- forward only, Failed is sticky, Success is final here (only a room failure fails
-- it: abort.lua, or the mark read by poll.lua). A participant that fails sets the
-- room's failure mark; one moving forward in a room that failed elsewhere (the mark
-- is set) becomes Failed with the mark's reason instead. A missing participant is
-- never re-created (rule 2). Idempotent.
-- KEYS[1] participant hash
-- KEYS[2] room hash (TTL refreshed with the participant's)
-- KEYS[3] room failure mark
-- ARGV[1] new status name
-- ARGV[2] reason (recorded when the new status is Failed)
-- ARGV[3] ttl in ms, refreshed whenever the status changes
-- ARGV[4] the failure mark's ttl in ms
-- ARGV[#ARGV], KEYS[#KEYS] (last) the trace TTL; the room's trace list unless that TTL is 0
--         (take_trace, _lib.lua)
-- Returns {status, reason} after the update; status '' means missing.
take_trace()
local key = KEYS[1]
local new = RANK[ARGV[1]]
if new == nil then return redis.error_reply('ERR unknown status ' .. tostring(ARGV[1])) end
local cur = read_status(key)
if cur[1] == '' or cur[1] == 'Failed' or cur[1] == 'Success' then return cur end
local mark = read_mark(KEYS[3])
if new == 0 or (mark and new > RANK[cur[1]]) then
  return fail_room(key, (new ~= 0) and mark or ARGV[2], ARGV[3], ARGV[4])
end
if new > RANK[cur[1]] then
  set_status(key, ARGV[1], now_text(), ARGV[3], nil)
  touch(KEYS[2], ARGV[3])
  trace(key, ARGV[1])
  return {ARGV[1], cur[2]}
end
return cur
