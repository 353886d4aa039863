-- trace.lua: one entry in a room's trace for an event that no other script makes: a
-- participant's clear (plain DEL/HDEL in the clear's MULTI/EXEC, where this call rides:
-- no round trip of its own). Appends only to a trace that exists (a participant that
-- never ran a script left none), with the server clock like every entry.
-- KEYS[1] the participant hash (named in the entry, never read: it is being deleted)
-- ARGV[#ARGV], KEYS[#KEYS] (last) the trace TTL; the room's trace list unless that TTL is 0
--         (take_trace, _lib.lua)
-- Returns 1.
take_trace()
trace(KEYS[1], F_EV_CLEARED)
return 1
