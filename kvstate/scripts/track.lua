-- track.lua: bind a receiver to a peer address in the address tracker, a
-- sorted set scored by deadline (server clock + ttl). Members past their
-- deadline are dropped here, so a room that was never cleared cannot keep the
-- tracker alive; the key's own TTL follows its latest deadline.
-- KEYS[1] address tracker  kvstate:<ns>:addr:<bootstrap addr>
-- ARGV[1] member: `<room> <receiver engine>` (Keys.tracker_member)
-- ARGV[2] ttl in ms
-- Returns the number of stale members dropped.
local now = now_ms()
local dropped = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return dropped
