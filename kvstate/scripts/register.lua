-- register.lua: one owner per engine name. Registering a manager, renewing its lease
-- and dropping it are this one script, so the check of which incarnation holds the
-- name and the write are atomic: a live owner (its key exists; the key's TTL is the
-- lease) is never displaced, and a process whose lease was taken learns it here.
-- KEYS[1] engine registration hash  kvstate:<ns>:engine:<engine>
-- ARGV[1] lease in ms
-- ARGV[2] the caller's incarnation
-- ARGV[3] mode: 'register' (a new manager), 'renew' (its heartbeat), 'drop' (its close)
-- ARGV[4..] field, value pairs of the registration, written whole when the name is free
-- Returns {answer, holder incarnation, holder host, holder pid}; answer is one of
--   registered  register: the name was free (or already ours: a retried call)
--   renewed     renew: still ours, lease extended
--   lapsed      renew: our lease had expired and the name was free: registered again
--   taken       another live incarnation holds the name; nothing written
--   dropped     drop: deleted   /   gone: drop found nothing of ours to delete
local key = KEYS[1]
local lease, me, mode = ARGV[1], ARGV[2], ARGV[3]
local holder = redis.call('HMGET', key, F_INCARNATION, F_HOST, F_PID)
if holder[1] and holder[1] ~= me then
  if mode == 'drop' then return {'gone', holder[1], holder[2] or '', holder[3] or ''} end
  return {'taken', holder[1], holder[2] or '', holder[3] or ''}
end
if mode == 'drop' then
  if not holder[1] then return {'gone', '', '', ''} end
  redis.call('DEL', key)
  return {'dropped', me, holder[2] or '', holder[3] or ''}
end
if holder[1] and mode == 'renew' then
  redis.call('PEXPIRE', key, lease)
  return {'renewed', me, holder[2] or '', holder[3] or ''}
end
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
-- the key is missing or ours: no DEL first (a script that wrote once is let through
-- when Redis is at maxmemory, so the HSET must be its first write to be refused there)
redis.call('HSET', key, F_INCARNATION, me, unpack(fields))
redis.call('PEXPIRE', key, lease)
local h = redis.call('HMGET', key, F_HOST, F_PID)
if mode == 'renew' then return {'lapsed', me, h[1] or '', h[2] or ''} end
return {'registered', me, h[1] or '', h[2] or ''}
