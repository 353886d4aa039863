-- abort.lua: fail every participant of a room with a reason, Success included
-- (the explicit abort of design rule 3), and one whose status is garbage; set the
-- room's failure mark (the first reason stays), so that a participant created later
-- (the other side had not joined yet, or already cleared) starts Failed. clear()
-- leaves the mark: it expires on its own TTL.
-- The caller read the room hash's participants first; if they changed since (a
-- participant joined or cleared), nothing is written and -1 is returned so the caller
-- reads them again.
-- KEYS[1] room hash
-- KEYS[2] room failure mark (hash: the reason, the failed request's participants)
-- KEYS[2+i] (i = 1..n) participant hash of room member i
-- ARGV[1] ttl in ms
-- ARGV[2] reason (unless the room already failed: its first reason stays)
-- ARGV[3] the failure mark's ttl in ms
-- ARGV[3+i] room member i (tx:<engine> / rx:<engine>), as the caller read it
-- ARGV[#ARGV], KEYS[#KEYS] (last) the trace TTL; the room's trace list unless that TTL
--         is 0 (take_trace, _lib.lua): after the participants, taken off first, so the lists
--         above hold
-- Returns the number of participants moved to Failed, or -1.
take_trace()
local room = KEYS[1]
local n = #KEYS - 2
-- the room's participants now: its fields but the transfer infos, acks and hold
local listed, count = {}, 0
for _, f in ipairs(room_call(room, 'HKEYS')) do
  if string.sub(f, 1, #F_XFER_PREFIX) ~= F_XFER_PREFIX
    and string.sub(f, 1, #F_ACK_PREFIX) ~= F_ACK_PREFIX and f ~= F_HOLD then
    listed[f], count = true, count + 1
  end
end
if count ~= n then return -1 end
for i = 1, n do
  if not listed[ARGV[3 + i]] then return -1 end
end
-- Read every participant before writing anything (a script's writes stay when it
-- errors): a key of the wrong type raises here, with nothing written. A status that
-- does not parse is failed like any other: the operator's way out of a corrupt room.
local statuses = {}
for i = 1, n do
  statuses[i] = redis.call('HGET', KEYS[2 + i], F_STATUS)
end
-- the room's first failure reason stays: participants fail with it; a corrupt mark
-- (another type) is replaced by mark_room
local first = redis.pcall('HGET', KEYS[2], F_REASON)
if type(first) == 'table' and not string.find(first.err, 'WRONGTYPE', 1, true) then
  raise(first)  -- the ACL refusing HGET...: as it is
end
local reason = type(first) == 'string' and first or ARGV[2]
mark_room(KEYS[2], room, reason, ARGV[3])
local now = now_text()
local failed = 0
for i = 1, n do
  if statuses[i] and statuses[i] ~= 'Failed' then
    set_status(KEYS[2 + i], 'Failed', now, ARGV[1], reason)
    trace(KEYS[2 + i], F_EV_ABORT, F_STATUS, 'Failed', F_REASON, reason,
      F_TRACE_WAS, statuses[i])
    failed = failed + 1
  end
end
if failed > 0 then touch(room, ARGV[1]) end
if failed == 0 then trace(nil, F_EV_ABORT, F_REASON, reason) end
return failed
