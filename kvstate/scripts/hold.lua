-- hold.lua: a decode engine holds a room whose request waits in its queue, so that the
-- room's senders do not fail in Bootstrapping (the decode has not published yet) while
-- the hold lasts: poll.lua's bootstrap timeout of a sender waits for it. A decode that
-- dies or drops the request stops renewing its holds, and the senders' timeout frees
-- their pages within the bootstrap timeout after the last hold ends. Only a room that
-- exists (a participant made its room hash) is held, and nothing else is written: a
-- hold never creates state (design rule 2), nor outlives the room (every clear
-- deletes it, the room hash keeps its TTL).
-- KEYS[1] room hash   kvstate:<ns>:{<room>}:room
-- ARGV[1] how long to hold it: ms from now on the server clock
-- Returns 1 when held, 0 when the room does not exist (yet, or any more).
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
room_call(KEYS[1], 'HSET', F_HOLD, now_ms() + tonumber(ARGV[1]))  -- raises if not a hash
return 1
