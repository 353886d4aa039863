-- index.lua: the address -> engines index, so a receiver finds the prefill engines of
-- its bootstrap address without SCAN. A sorted set scored by each engine's lease
-- deadline (server clock); members past their deadline are dropped here and the key's
-- TTL follows its latest deadline, so a dead engine leaves the index within a lease.
-- A member is "<engine> <incarnation> <ranks> <role>" (kvstate.registry.index_member):
-- one read of the index tells a receiver whom to bind, at which incarnation, without
-- reading each registration (publish.lua's lookup reads it in the same way).
-- KEYS[1] index  kvstate:<ns>:engines_at:<bootstrap addr>
-- ARGV[1] the member; to remove, "<engine> <incarnation>" (its members go); or '' to
--         read: the live members (deadline after now) are returned
-- ARGV[2] lease left in ms, or '' to remove (the engine's close); unused by a read
-- Returns 1 if the index holds an engine afterwards, else 0 (the key is gone); a read
-- returns {member, deadline ms, ...} of the live members.
local key = KEYS[1]
local now = now_ms()
if ARGV[1] == '' then
  return redis.call('ZRANGE', key, '(' .. now, '+inf', 'BYSCORE', 'WITHSCORES')
end
-- ZADD first: at maxmemory Redis refuses a script's first memory-taking write, and
-- lets everything after any earlier write through
if ARGV[2] == '' then
  local gone = ARGV[1] .. ' '  -- "<engine> <incarnation>": that incarnation's member
  for _, m in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    if string.sub(m, 1, #gone) == gone then redis.call('ZREM', key, m) end
  end
else
  redis.call('ZADD', key, now + tonumber(ARGV[2]), ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
if #last == 0 then return 0 end
redis.call('PEXPIRE', key, math.max(1, tonumber(last[2]) - now))
return 1
