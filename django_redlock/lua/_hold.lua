-- Helpers for the lock's own key, spliced into scripts by `--! include _hold`.
-- A plain hold is a string 'token|fence|acquired-ms|holder' (SET NX PX);
-- a reentrant hold is a hash {owner = count, ':fence', ':at', ':meta', ':seq'}.

-- The server's clock in ms (TTL arithmetic); the same reading in us is kept for fence_next.
-- `t`: a TIME reply the script read already (none: read now).
local now_us = 0
local function now_ms(t)
  t = t or redis.call('TIME')
  now_us = t[1] * 1000000 + t[2]
  return t[1] * 1000 + math.floor(t[2] / 1000)
end

-- Whether a redis.pcall reply is WRONGTYPE (a name taken by another kind of lock). Any other
-- error (the user's ACL refused the command) is raised: it says nothing about the hold.
local function wrongtype(reply)
  if type(reply) ~= 'table' or not reply.err then
    return false
  end
  if string.sub(reply.err, 1, 9) ~= 'WRONGTYPE' then
    error(reply)
  end
  return true
end

-- How many holds `token` has on `lock` (0: none), and the hold's fence. `kind`: the key's
-- TYPE if the caller has it, else the type the caller's hold would have ('string': plain,
-- 'hash': reentrant), read without asking for the TYPE. A key of another type (a name taken by
-- both kinds) holds nothing of the caller's: its read is an error, caught, and the answer 0
-- (the third value then true: see other_kind).
local function hold_mine(lock, token, kind)
  kind = kind or redis.call('TYPE', lock).ok
  if kind == 'string' then
    local value = redis.pcall('GET', lock)
    if wrongtype(value) then -- raises an ACL's refusal; a WRONGTYPE error is no string
      return 0, nil, true
    end
    if type(value) == 'string' and string.sub(value, 1, #token + 1) == token .. '|' then
      return 1, tonumber(string.match(value, '^[^|]*|(%d+)'))
    end
  elseif kind == 'hash' then
    local count = redis.pcall('HGET', lock, token)
    if wrongtype(count) then
      return 0, nil, true
    end
    count = tonumber(count)
    if count then
      return count, tonumber(redis.call('HGET', lock, ':fence'))
    end
  end
  return 0, nil
end

-- A reentrant owner's writes are ordered: each carries a number its process drew after every
-- earlier one (identity.write_seq), and the hold keeps the newest it applied in ':seq' (one
-- owner per hold: one field). A request that ran late (it sat in a dead connection's buffer
-- or a paused server's queue: its reply timed out, and the owner's settle, on another
-- connection, ran first) is older than that: refused, it changes nothing. `seq` nil: an
-- unordered write (none of the package's own).
local function order_stale(lock, seq)
  if not seq then
    return false
  end
  local last = tonumber(redis.call('HGET', lock, ':seq'))
  return last ~= nil and seq <= last
end

-- An ordered reentrant write's 'seq|count[|fence]' (ARGV), as numbers (fence: the hold's the
-- owner's levels are in, nil when not sent); nil for anything else.
local function order_read(arg)
  local seq, count, fence = string.match(arg or '', '^(%d+)|(%d+)|?(%d*)$')
  return tonumber(seq), tonumber(count), tonumber(fence)
end

-- The next fence of a name: above its counter, and at least the server's clock in us. Two
-- scripts never read the same microsecond, so a counter lost with the data (restarted empty,
-- flushed, failed over to a lagging replica) or expired (below) starts again above every
-- fence handed out before, unless the server's clock went back meanwhile (ms x 1000 tied
-- within the millisecond of a flush). Always written and read as integer text: a Lua number
-- turned into text directly would lose digits ('1.76e+15').
-- The counter's value is 'fence|token': the last fence handed out, and the token of the last
-- exclusive hold given one (a fenced block records it in the database: a block finding the
-- token of the hold taken before its own there knows that no later hold committed, without
-- asking Redis). A bare 'fence' (written before the token was kept) reads with token ''.
local function fence_read(counter)
  local value = redis.call('GET', counter)
  if not value then
    return 0, ''
  end
  local fence, last = string.match(value, '^(%d+)|?(.*)$')
  return tonumber(fence) or 0, last or ''
end

-- The next fence (a number, and as text), and the token of the last hold given one ('':
-- none known): the hold granted before this one.
local function fence_next(counter)
  local last, prior = fence_read(counter)
  local fence = math.max(last + 1, now_us)
  return fence, string.format('%d', fence), prior
end

-- How long a name's counter outlives its last fence: the clock carries fences past a lost
-- counter, so only a clock stepped back (a Redlock node's behind another's) by more than
-- this could hand out a smaller one. A name used once leaves no key behind for ever.
local FENCE_MEMORY_MS = 60000

-- `token`: the exclusive hold just given `text` (a shared lease keeps the last one's: it never
-- records a fence in the database).
local function fence_keep(counter, text, ttl, token)
  redis.call('SET', counter, text .. '|' .. token, 'PX', math.max(tonumber(ttl), FENCE_MEMORY_MS))
end

-- One name is one kind at a time. A lock (plain, reentrant or fair: a string or hash, which
-- exclude each other as holds of one lock) found the name's key of another type: the kind
-- whose live leases hold it ('semaphore', 'read-write lock': the ':kind' its last grant
-- wrote in the details), or false. A sorted set of expired leases only is dropped with its
-- details (their holders can renew none of them), so the name is free for the lock: then
-- the second value is true. Runs
-- only after a read of the key failed with WRONGTYPE: a free name or a lock of the same kind
-- costs nothing here.
local function other_kind(lock, now)
  if redis.call('TYPE', lock).ok ~= 'zset' then
    return false
  end
  local details = lock .. ':h'
  if redis.call('ZCOUNT', lock, '(' .. string.format('%d', now), '+inf') == 0 then
    redis.call('DEL', lock, details)
    return false, true
  end
  return redis.call('HGET', details, ':kind') == 's' and 'semaphore' or 'read-write lock'
end

-- Take a free lock with the next fence. Returns the fence and the token of the hold given a
-- fence before it ('': unknown), or nil when the lock is held. `reentrant`: false (plain),
-- true, or the write's number (order_stale), kept in the hold.
-- The counter is read before the lock is written (a held lock costs no write), and written
-- after: one GETSET after the SET NX would save a call, but costs two more writes whenever
-- the name was taken in the same ms already (fence = counter + 1 then), half the time at a
-- few thousand holds a second.
local function hold_take(lock, counter, token, ttl, meta, reentrant, now)
  if reentrant and redis.call('EXISTS', lock) == 1 then
    return nil
  end
  local at = string.format('%d', now)
  local fence, text, prior = fence_next(counter)
  if reentrant then
    redis.call('HSET', lock, token, 1, ':fence', text, ':at', at, ':meta', meta,
               ':seq', reentrant == true and 0 or reentrant)
    redis.call('PEXPIRE', lock, ttl)
  elseif not redis.call('SET', lock, token .. '|' .. text .. '|' .. at .. '|' .. meta,
                        'NX', 'PX', ttl) then
    return nil
  end
  fence_keep(counter, text, ttl, token)
  return fence, prior
end

-- Whether waiters listen on the release channel: Redis 6 clusters and Redlock's nodes. ''
-- elsewhere; and on a Redis 7+ cluster (a sharded inbox prefix ends with '*') the channel
-- is passed only because a cluster script's keys must share the lock's slot: every waiter
-- there is woken in its inbox, and a release announces nothing.
local function announces(channel, inbox)
  return channel ~= '' and string.byte(inbox or '', -1) ~= 42
end

-- Free a lock (delete it), tell those that listen on its release channel, and say whether
-- anyone registered or queued to be woken (lock_wake in _queue.lua wakes them). A waiter
-- registers (plain) or queues (fair) before it sleeps, so a lock nobody waits for costs one
-- EXISTS here. Where a PUBLISH will follow, the ACL is asked before the DEL (may_publish,
-- in _may_publish.lua: the script includes it).
local function lock_freed(lock, channel, waiting, queue, inbox)
  local announce = announces(channel, inbox)
  local wakes = redis.call('EXISTS', waiting, queue) > 0
  if announce or wakes then
    may_publish(wakes and inbox, announce and channel)
  end
  redis.call('DEL', lock)
  if announce then
    publish_call('PUBLISH', channel, 'released')
  end
  return wakes
end
