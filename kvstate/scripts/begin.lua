-- begin.lua: a sender is about to write into its receivers' pages. It moves to
-- Transferring only if the room has not failed (no failure mark) and every receiver
-- it will write to is still there and not Failed; otherwise the sender fails with
-- that reason (and marks the room) and nothing should be written (a failed receiver
-- may already be handing its pages to another request). A sender still
-- Bootstrapping (not every required receiver has bound and published) is answered
-- as it is, nothing written: the caller refuses. Forward-only and sticky like
-- update.lua; idempotent. Everything is read before anything is written (rule 7).
-- KEYS[1] sender participant hash
-- KEYS[2] room hash (TTL refreshed with the participant's)
-- KEYS[3] room failure mark
-- KEYS[3+j] (j = 1..m) receiver j's participant hash
-- ARGV[1] ttl in ms
-- ARGV[2] the failure mark's ttl in ms
-- ARGV[3] unused, so that ARGV[k] names the receiver of KEYS[k]
-- ARGV[3+j] receiver j's engine (named in the reason)
-- ARGV[#ARGV], KEYS[#KEYS] (last) the trace TTL; the room's trace list unless that TTL
--         is 0 (take_trace, _lib.lua): after the receivers, taken off first, so the lists
--         above hold
-- Returns the sender's {status, reason}; status '' means missing.
take_trace()
local tx = KEYS[1]
local ttl = ARGV[1]
local cur = read_status(tx)
if cur[1] == '' or cur[1] == 'Failed' or cur[1] == 'Success' then return cur end
local mark = read_mark(KEYS[3])
local why = nil
for j = 4, #KEYS do  -- every receiver read: a corrupt one raises before any write
  local refuses = receiver_refuses(KEYS[j], ARGV[j])
  why = why or refuses
end
why = why or mark
if why then return fail_room(tx, why, ttl, ARGV[2]) end
if cur[1] == 'Bootstrapping' then return cur end
if cur[1] ~= 'Transferring' then
  set_status(tx, 'Transferring', now_text(), ttl, nil)
  touch(KEYS[2], ttl)
  trace(tx, 'Transferring')
end
return {'Transferring', cur[2]}
