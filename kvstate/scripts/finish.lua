-- finish.lua: a sender finished moving its pages. Sender Transferring -> Success; for
-- each receiver still waiting, add this sender to its acks (the room hash's field
-- ack:<receiver>, the senders SEP-joined) and flip it to Success when
-- every required sender has acked (its peers: a receiver this sender writes to has
-- bound it, so knows how many it needs; a peers that is no count from 1 up, or an ack
-- list naming a sender twice, one it is not bound to, or more than it needs, is
-- corrupt: never counted towards a Success). One outcome per room (design rule 3): in a room
-- that failed (its failure mark is set), or with a receiver Failed or gone, the sender
-- fails with that reason instead, and acks nothing. A sender not yet Transferring
-- (finish without begin) is answered as it is, nothing written: the caller refuses.
-- A Failed or missing sender acks nothing; no resurrection. Everything is read and
-- checked before anything is written (rule 7). Idempotent: a Success answered again
-- refreshes its TTLs (durable mode: the WAIT covers the first, unconfirmed answer).
-- KEYS[1] sender participant hash
-- KEYS[2] room hash (TTL refreshed with the participants'; the acks)
-- KEYS[3] room failure mark
-- KEYS[3+j] (j = 1..m) receiver j's participant hash
-- ARGV[1] ttl in ms
-- ARGV[2] sender engine (the name added to each receiver's acks)
-- ARGV[3] the failure mark's ttl in ms
-- ARGV[3+j] receiver j's engine (named in a reason)
-- ARGV[#ARGV], KEYS[#KEYS] (last) the trace TTL; the room's trace list unless that TTL
--         is 0 (take_trace, _lib.lua): after the receivers, taken off first, so the lists
--         above hold
-- Returns the sender's {status, reason}; status '' means missing.
take_trace()
local tx = KEYS[1]
local ttl = ARGV[1]
local cur = read_status(tx)
if cur[1] == '' or cur[1] == 'Failed' then return cur end
local mark = read_mark(KEYS[3])
local why = nil
local m = #KEYS - 3
-- receivers to ack: {key, acks field, peers, the new acks value (nil: acked before),
-- how many acked after this one}
local waiting = {}
if cur[1] == 'Transferring' then
  for j = 1, m do
    local rx = KEYS[3 + j]
    local r = redis.call('HMGET', rx, F_STATUS, F_PEERS, F_REASON)
    local rank = r[1] and rank_of(rx, r[1])
    if not r[1] then
      why = why or ('receiver ' .. ARGV[3 + j] .. ' is gone (cleared or expired) before the transfer finished')
    elseif rank == 0 then
      why = why or ('receiver ' .. ARGV[3 + j] .. ' failed before the transfer finished: ' .. (r[3] or ''))
    elseif rank ~= 4 then
      -- a receiver this sender writes to has bound and published: it knows how many
      -- senders it needs (at least this one)
      waiting[#waiting + 1] = {rx, F_ACK_PREFIX .. ARGV[3 + j],
        count_of(rx, F_PEERS, r[2], 1, MAX_PEERS)}
    end
  end
end
if #waiting > 0 then  -- their acks so far, in one read of the room hash
  local fields = {}
  for i, w in ipairs(waiting) do fields[i] = w[2] end
  local acks = room_call(KEYS[2], 'HMGET', unpack(fields))
  for i, w in ipairs(waiting) do
    local list = acks[i] or ''
    if #list > MAX_ACKS_BYTES then corrupt(KEYS[2], w[2], list) end
    -- every other sender listed must be one this receiver is bound to, each once, no
    -- more of them than it needs: a list that is not is corrupt, never a count
    local n, seen, others, listed = 0, false, {}, {}
    for s in string.gmatch(list, '[^' .. F_SEP .. ']+') do
      n = n + 1
      if listed[s] then corrupt(KEYS[2], w[2], list) end
      listed[s] = true
      if s == ARGV[2] then seen = true else others[#others + 1] = F_PEER_PREFIX .. s end
    end
    if not seen then
      n = n + 1
      w[4] = (list == '') and ARGV[2] or (list .. F_SEP .. ARGV[2])
    end
    if n > w[3] then corrupt(KEYS[2], w[2], list) end
    if #others > 0 then
      for _, inc in ipairs(redis.call('HMGET', w[1], unpack(others))) do
        if not inc then corrupt(KEYS[2], w[2], list) end
      end
    end
    w[5] = n
  end
end
why = why or mark
if why then return fail_room(tx, why, ttl, ARGV[3]) end
if cur[1] ~= 'Transferring' and cur[1] ~= 'Success' then return cur end
if cur[1] ~= 'Success' then
  set_status(tx, 'Success', now_text(), ttl, nil)
  trace(tx, 'Success')
end
if cur[1] == 'Success' then redis.call('PEXPIRE', tx, ttl) end
for _, w in ipairs(waiting) do
  if w[4] then redis.call('HSET', KEYS[2], w[2], w[4]) end  -- unless acked before
  if w[5] >= w[3] then
    set_status(w[1], 'Success', now_text(), ttl, nil)
    notify(w[1])  -- its engine's waiting step polls it (change notices)
    trace(w[1], 'Success')
  end
end
touch(KEYS[2], ttl)  -- after the acks' writes: the room hash may have expired meanwhile
return {'Success', ''}
