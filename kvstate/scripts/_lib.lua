-- _lib.lua: helpers that kvstate prepends to every script below; not a script itself.
-- Times come from the server clock (TIME), never from a client (design rule 9).
-- Corrupt stored values raise "CORRUPT <key> <field> <value>", which the client
-- turns into CorruptStateError naming the key and field.
redis.replicate_commands()  -- Redis 6.2 needs this before writing after TIME

-- Stored field names: a mirror of kvstate/schema.py (same names, F_ in front);
-- tests/test_schema_lua.py holds the two together. Change a field in both, nowhere else.
local F_STATUS = 'status'
local F_SINCE_MS = 'since_ms'
local F_REASON = 'reason'
local F_PEERS = 'peers'
local F_PEER_ADDR = 'peer_addr'
local F_TIMEOUTS_MS = 'timeouts_ms'
-- the timeouts of a participant that stores no F_TIMEOUTS_MS (kvstate.defaults')
local F_DEFAULT_TIMEOUTS_MS = '300000 300000'
local F_INFOS_V = 'infos_v'
local F_BOUND = 'bound'
local F_PEER_PREFIX = 'peer:'
local F_INCARNATION = 'incarnation'
local F_HOST = 'host'
local F_PID = 'pid'
local F_CREATED_MS = 'created_ms'
-- the room hash's fields besides its participants (tx:<engine> / rx:<engine>):
-- xfer:<sender>,<receiver> -> packed transfer info; ack:<receiver> -> the senders that
-- finished for it, joined by F_SEP
local F_XFER_PREFIX = 'xfer:'
local F_ACK_PREFIX = 'ack:'
-- hold -> a decode engine holds the room queued until this server time in ms (hold.lua)
local F_HOLD = 'hold'
local F_SEP = ','
-- the room trace's fields and events (besides the status names)
local F_TRACE_MS = 'ms'
local F_TRACE_SIDE = 'side'
local F_TRACE_ENGINE = 'engine'
local F_TRACE_EVENT = 'event'
local F_TRACE_PEER = 'peer'
local F_TRACE_WAS = 'was'
local F_EV_CREATED = 'created'
local F_EV_BOUND = 'bound'
local F_EV_PUBLISHED = 'published'
local F_EV_ABORT = 'abort'
local F_EV_CLEARED = 'cleared'

local RANK = {Failed = 0, Bootstrapping = 1, WaitingForInput = 2, Transferring = 3, Success = 4}

-- The bounds of stored numbers (kvstate.schema's MAX_ / MIN_ names, the same values;
-- tests/test_schema_lua.py holds them together): a value outside them is corrupt, never
-- read as a count (design rule 7; issue 30).
local MAX_PEERS = 65536  -- peers, bound, an index member's ranks, acks of a receiver
local MAX_COUNT = 1099511627776  -- infos_v: 2^40 (written back by HSET, as %.14g digits)
local MAX_TIMEOUT_MS = 4398046511104  -- each of timeouts_ms: 2^42 ms, 139 years
local MIN_TIME_MS = 1000000000000  -- created_ms, since_ms: not before 2001-09-09
local MAX_SKEW_MS = 60000  -- nor more than a minute past the server clock
local MAX_ACKS_BYTES = 65536  -- an ack:<receiver> list (engine names, SEP-joined)

-- The server clock in ms: TIME at most once per script, and only when a script
-- needs it (most calls change no status and never ask). now_text() is what a script
-- writes (created_ms, since_ms...), made from TIME's digits: a Lua number passed to
-- redis.call is formatted by sprintf("%.14g"), a measurable part of Redis CPU per
-- lifecycle; now_ms() is the same instant as a number, for arithmetic.
local clock = nil
local clock_text = nil
local function now_text()
  if clock_text == nil then
    local t = redis.call('TIME')  -- {seconds, microseconds}, both digits only
    clock_text = t[1] .. string.sub('00000' .. t[2], -6, -4)
  end
  return clock_text
end

local function now_ms()
  if clock == nil then
    clock = tonumber(now_text())
  end
  return clock
end

-- (a value is named in the error cut to 64 bytes: a hostile one may be megabytes)
local function corrupt(key, field, value)
  local text = tostring(value)
  if #text > 64 then text = string.sub(text, 1, 64) .. '... (' .. #text .. ' bytes)' end
  error('CORRUPT ' .. key .. ' ' .. field .. ' ' .. text)
end

-- Raise an error reply that redis.pcall caught (the ACL refusing a command...) as
-- redis.call would have. Redis 7 raises the reply itself; 6.2's error handler cannot
-- take a table (it answers "attempt to concatenate"), so there its text goes, with no
-- position added (level 0).
local function raise(reply)
  if redis.REDIS_VERSION_NUM then error(reply) end
  error(reply.err, 0)
end

local function rank_of(key, status)
  local r = RANK[status]
  if r == nil then corrupt(key, F_STATUS, status) end
  return r
end

-- A stored count (peers, bound, infos_v, a timeout...): ASCII digits as kvstate writes
-- them (no leading zero), from `min` to `max`. Anything else is corrupt: a missing
-- value, a sign, a fraction, an exponent, hex, NaN, inf, spaces, a huge number or
-- string (tonumber() takes most of those).
local function count_of(key, field, value, min, max)
  if type(value) ~= 'string' or #value > 16 or not string.find(value, '^%d+$')
    or (#value > 1 and string.byte(value) == 48) then  -- 48: '0'
    corrupt(key, field, value)
  end
  local n = tonumber(value)
  if n < min or n > max then corrupt(key, field, value) end
  return n
end

-- A stored server time in ms (created_ms, since_ms): a count from MIN_TIME_MS to a
-- minute past the server clock (a failover's new primary may lag the old one's).
local function time_of(key, field, value)
  return count_of(key, field, value, MIN_TIME_MS, now_ms() + MAX_SKEW_MS)
end

-- Move a participant to `status`, stamp it, and refresh its TTL in the same call.
local function set_status(key, status, now, ttl, reason)
  if reason then
    redis.call('HSET', key, F_STATUS, status, F_SINCE_MS, now, F_REASON, reason)
  else
    redis.call('HSET', key, F_STATUS, status, F_SINCE_MS, now)
  end
  redis.call('PEXPIRE', key, ttl)
end

-- Keep the room hash alive as long as its participants: every script that refreshes a
-- participant's TTL refreshes it too (PEXPIRE never creates it), and every script that
-- writes into it, after the write.
local function touch(room, ttl)
  redis.call('PEXPIRE', room, ttl)
end

-- A reply of redis.pcall on `key`, returned as it is unless it is an error: WRONGTYPE
-- means the key is corrupt (`what` it is instead, named before the calling script wrote
-- anything: design rule 7); any other error (the ACL refusing the command...) is raised
-- as it is.
local function checked(key, what, reply)
  if type(reply) == 'table' and reply.err then
    if string.find(reply.err, 'WRONGTYPE', 1, true) then corrupt(key, '*', what) end
    raise(reply)
  end
  return reply
end

-- `cmd` on the room hash (KEYS: kvstate:<ns>:{<room>}:room, a small listpack), with
-- its type checked: a key of another type is corrupt (checked()).
local function room_call(room, cmd, ...)
  return checked(room, 'not a hash', redis.pcall(cmd, room, ...))
end

-- The transfer infos addressed to `sender` in a room hash read by HGETALL (`all`):
-- {receiver, info, ...}, the field prefix stripped (plain comparison: engine names may
-- hold pattern characters).
local function infos_in(all, sender)
  local prefix = F_XFER_PREFIX .. sender .. F_SEP
  local n, out = #prefix, {}
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, n) == prefix then
      out[#out + 1] = string.sub(all[i], n + 1)
      out[#out + 1] = all[i + 1]
    end
  end
  return out
end

-- The room's failure mark (KEYS: kvstate:<ns>:{<room>}:aborted), a hash: `reason`, the
-- reason of the room's first failure, and one field per participant of the failed
-- request (its room-hash member, value ''). read_mark returns the reason, or nil. A
-- mark that is not a hash is corrupt (named here, before the calling script wrote
-- anything: design rule 7).
local function read_mark(mark)
  return checked(mark, 'not a hash', redis.pcall('HGET', mark, F_REASON))
end

-- Whether a room-hash field is a participant (tx:<engine> / rx:<engine>).
local function is_member(field)
  local side = string.sub(field, 1, 3)
  return side == 'tx:' or side == 'rx:'
end

-- Whether the room hash (`room`) still lists a participant.
local function has_members(room)
  for _, f in ipairs(room_call(room, 'HKEYS')) do
    if is_member(f) then return true end
  end
  return false
end

-- Tell a participant's engine that the room changed for it (a change notice,
-- kvstate.roles.notices): PUBLISH the room id on kvstate:<ns>:changed:<engine>, the
-- channel kvstate.keys.Keys.changed names, built from the participant's key
-- kvstate:<ns>:{<room>}:<tx|rx>:<engine>. PUBLISH takes no key (a script on a Cluster
-- may call it; the Cluster broadcasts it). By redis.pcall: a notice is a hint (the
-- engine's sweep polls every room anyway), so an ACL without the channel never fails
-- the script after its writes.
local function notify(key)
  local prefix, room, engine = string.match(key, '^([^{]*){(%d+)}:[tr]x:(.+)$')
  if prefix then redis.pcall('PUBLISH', prefix .. 'changed:' .. engine, room) end
end

-- Record that the room failed (design rule 3, one outcome per room): the first reason
-- stays, with the participants the room had then (`room`: the room hash), so that each
-- one's next participant, once all have cleared, is a new request (create.lua); the
-- TTL is refreshed either way, so the call always writes (durable mode's WAIT then
-- covers an earlier, unconfirmed one). clear() never deletes the mark. A mark of
-- another type (written by hand) is replaced, as abort.lua does. Every member's engine
-- is notified (notify), at the first failure and every later one: each of them reads
-- Failed at its next poll (failures are rare; the HKEYS is on their path only).
local function mark_room(mark, room, reason, ttl)
  local first = redis.pcall('HSETNX', mark, F_REASON, reason)
  if type(first) == 'table' then
    if not string.find(first.err, 'WRONGTYPE', 1, true) then raise(first) end
    redis.call('DEL', mark)
    first = redis.call('HSET', mark, F_REASON, reason)
  end
  local named, fields = {}, redis.pcall('HKEYS', room)
  if fields.err then fields = {} end  -- a corrupt room hash names nobody: no error
  local base = string.sub(room, 1, -5)  -- kvstate:<ns>:{<room>}: (room: ...:room)
  for _, f in ipairs(fields) do
    if is_member(f) then
      named[#named + 1] = f
      named[#named + 1] = ''
      notify(base .. f)
    end
  end
  if first == 1 and #named > 0 then redis.call('HSET', mark, unpack(named)) end
  redis.call('PEXPIRE', mark, ttl)
end

-- {status, reason} of a participant; {'', 'missing'} when it does not exist.
local function read_status(key)
  local h = redis.call('HMGET', key, F_STATUS, F_REASON)
  if not h[1] then return {'', 'missing'} end
  rank_of(key, h[1])
  return {h[1], h[2] or ''}
end

-- Why a sender may not write into receiver `name`'s pages (its participant hash `key`):
-- gone (cleared or expired) or Failed, when a failed receiver may be handing its pages
-- to another request; nil when it may. begin.lua and poll.lua's begin read it.
local function receiver_refuses(key, name)
  local r = read_status(key)
  if r[1] == '' then
    return 'receiver ' .. name .. ' is gone (cleared or expired) before the transfer'
  elseif r[1] == 'Failed' then
    return 'receiver ' .. name .. ' failed before the transfer: ' .. r[2]
  end
  return nil
end

-- The room trace (kvstate/trace.py). Every room script is called with the trace TTL in
-- ms as its LAST argument: > 0 the room is traced; 0 it is not (nothing written); < 0
-- append only to a trace that exists (an abort by a process that does not trace the
-- room, a clear); and, unless that TTL is 0, with the room's trace list as its LAST key
-- (an untraced call carries neither key nor value it would not use: each argument costs
-- Redis CPU to parse and to hand to Lua). take_trace() takes them off ARGV and KEYS,
-- first thing, so that the script reads its lists as its header says (into locals, not
-- a table: this runs on every call).
local trace_key = nil
local trace_ttl = nil
local trace_timed = nil  -- the list's TTL set by this call
local function take_trace()
  local a = #ARGV
  trace_ttl = tonumber(ARGV[a]) or 0
  ARGV[a] = nil
  if trace_ttl ~= 0 then
    local k = #KEYS
    trace_key = KEYS[k]
    KEYS[k] = nil
  end
end

-- Append one entry (a JSON object) to the room's trace, if it is traced: the server
-- clock in ms (design rule 9), who (tx/rx and engine, read from the participant key
-- `key`; nil for the room itself), the event, then field, value pairs (a nil value drops
-- its pair). Each call refreshes the list's TTL, so the trace outlives its room. Called
-- after every read that can raise (bad input writes nothing, design rule 7) and, where
-- the script allows, after its own writes (at maxmemory the state write is refused).
local function trace(key, event, ...)
  local ttl = trace_ttl
  if ttl == 0 then return end
  local side, engine = nil, nil
  if key then side, engine = string.match(key, '}:([tr]x):(.*)$') end
  local entry = {[F_TRACE_MS] = now_ms(), [F_TRACE_SIDE] = side or '',
    [F_TRACE_ENGINE] = engine or '', [F_TRACE_EVENT] = event}
  for i = 1, select('#', ...), 2 do
    local name, value = select(i, ...)
    if value ~= nil then entry[name] = value end
  end
  if ttl < 0 then
    if redis.call('RPUSHX', trace_key, cjson.encode(entry)) == 0 then return end
  else
    redis.call('RPUSH', trace_key, cjson.encode(entry))
  end
  if not trace_timed then  -- the TTL once per script call: its entries share its clock
    redis.call('PEXPIRE', trace_key, math.abs(ttl))
    trace_timed = true
  end
end

-- Fail participant `key` with `reason`, and its room with it (design rule 3): its status
-- and TTL, the room hash's TTL, the room's failure mark and the trace entry; the room
-- hash and the mark are every room script's KEYS[2] and KEYS[3]. Returns the reply.
local function fail_room(key, reason, ttl, mark_ttl)
  set_status(key, 'Failed', now_text(), ttl, reason)
  touch(KEYS[2], ttl)
  mark_room(KEYS[3], KEYS[2], reason, mark_ttl)
  trace(key, 'Failed', F_REASON, reason)
  return {'Failed', reason}
end
