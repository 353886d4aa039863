-- index.lua: the address -> engines index, so a receiver finds the prefill engines of
-- its bootstrap address without SCAN. A sorted set scored by each engine's lease
-- deadline (server clock); members past their deadline are dropped here and the key's
-- TTL follows its latest deadline, so a dead engine leaves the index within a lease.
-- The engine's own registration (register.lua) stays the truth: readers check it.
-- KEYS[1] index  kvstate:<ns>:engines_at:<bootstrap addr>
-- ARGV[1] engine
-- ARGV[2] lease in ms, or '' to remove the engine (its close)
-- Returns 1 if the index holds an engine afterwards, else 0 (the key is gone).
local key = KEYS[1]
local now = now_ms()
-- ZADD first: at maxmemory Redis refuses a script's first memory-taking write, and
-- lets everything after any earlier write through
if ARGV[2] == '' then
  redis.call('ZREM', key, ARGV[1])
else
  redis.call('ZADD', key, now + tonumber(ARGV[2]), ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
if #last == 0 then return 0 end
redis.call('PEXPIRE', key, math.max(1, tonumber(last[2]) - now))
return 1
