-- _lib.lua: helpers that kvstate prepends to every script below; not a script itself.
-- Times come from the server clock (TIME), never from a client (design rule 9).
-- Corrupt stored values raise "CORRUPT <key> <field> <value>", which the client
-- turns into CorruptStateError naming the key and field.
redis.replicate_commands()  -- Redis 6.2 needs this before writing after TIME
local RANK = {Failed = 0, Bootstrapping = 1, WaitingForInput = 2, Transferring = 3, Success = 4}

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function corrupt(key, field, value)
  error('CORRUPT ' .. key .. ' ' .. field .. ' ' .. tostring(value))
end

local function rank_of(key, status)
  local r = RANK[status]
  if r == nil then corrupt(key, 'status', status) end
  return r
end

local function number_of(key, field, value)
  local n = tonumber(value)
  if n == nil then corrupt(key, field, value) end
  return n
end

-- Move a participant to `status`, stamp it, and refresh its TTL in the same call.
local function set_status(key, status, now, ttl, reason)
  if reason then
    redis.call('HSET', key, 'status', status, 'since_ms', now, 'reason', reason)
  else
    redis.call('HSET', key, 'status', status, 'since_ms', now)
  end
  redis.call('PEXPIRE', key, ttl)
end

-- Keep the room's parts index alive as long as its participants: every script that
-- refreshes a participant's TTL refreshes the index too (PEXPIRE never creates it).
local function touch(parts, ttl)
  redis.call('PEXPIRE', parts, ttl)
end

-- {status, reason} of a participant; {'', 'missing'} when it does not exist.
local function read_status(key)
  local h = redis.call('HMGET', key, 'status', 'reason')
  if not h[1] then return {'', 'missing'} end
  rank_of(key, h[1])
  return {h[1], h[2] or ''}
end
