-- Take a lease on a semaphore (mode 's': at most `limit` at once) or a read-write lock
-- (mode 'r': many readers; 'w': one writer, no readers) in one atomic step.
-- KEYS: leases, details, fence counter, release channel (the leases' own key where nobody
--       listens there), plain waiters, queue, deadlines, waiting writers[, hand-back marker
--       (a permit's or a write's token's, see permit_release.lua; a reader's, see
--       permit_mark.lua)].
-- ARGV: token, ttl ms, holder metadata, mode, limit (s), fair ('1'/'0', s)[, waiter id,
--       wait ms (-1: a one-off try that never queues or registers), inbox channel prefix,
--       the caller's read token (w: a reader asking to write is refused, or it would wait
--       for itself forever): the four left out by a permit's one-off try][, a read's write
--       number (identity.write_seq), with a reader's marker].
-- Returns {1, fence, hold count, token of the exclusive hold given a fence before (a writer's;
-- '': unknown)} when held by the caller; {0, ms until something may change
-- (-1: wait for a message)}; {-2, kind} when another kind holds the name ('lock': a plain,
-- reentrant or fair one; 'semaphore'; 'read-write lock'); {-3} for a read-to-write upgrade;
-- {0, -1} for a token handed back (its marker there: a hand-back, on another connection,
-- overtook this try on the wire), which takes and registers nothing (see acquire.lua); for a
-- read, whose token is its owner's and taken again, only when its write number is not above
-- the marker's (a read sent before the owner's settle: permit_mark.lua).
-- One name is one kind at a time: a lock's key is a string or hash (WRONGTYPE here), and a
-- semaphore's and a read-write lock's live leases are told apart by the details' ':kind'
-- (see _permits.lua), looked up only when the name has leases already.
-- The waiting, queueing and waking helpers are spliced in after the common case (a permit
-- free, nobody queued, a one-off try) has returned: taking a free permit never defines them.
-- A registered semaphore waiter's take tells the next waiter to stand down (the bounded
-- hand-off: HAND_OFF_MS in _wake.lua).
--! include _may_publish
--! include _hold
--! include _permits
local leases, details, counter, channel = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
if channel == leases then
  channel = ''
end
local waiting, queue, deadlines, writers = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local token, ttl, meta, mode = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local limit, fair = tonumber(ARGV[5]), ARGV[6] == '1'
local waiter, wait = ARGV[7] or token, tonumber(ARGV[8] or '-1')
local inbox, reader = ARGV[9] or '', ARGV[10] or ''
local back = KEYS[9]
if back and mode == 'r' then
  local last = tonumber(redis.call('GET', back))
  if last and (tonumber(ARGV[11]) or 0) <= last then
    return {0, -1}
  end
elseif back and redis.call('EXISTS', back) == 1 then
  return {0, -1}
end
local now = now_ms()

-- A lock has this name (a string or hash: WRONGTYPE). A semaphore counts its leases first,
-- expired ones too: with none at all, none is ours (no ZSCORE to look for it), and none is
-- a read-write lock's.
local expiry, all = false, nil
if mode == 's' then
  all = redis.pcall('ZCARD', leases)
  if wrongtype(all) then
    return {-2, 'lock'}
  end
  if all > 0 then
    if redis.call('HGET', details, ':kind') == 'rw' then
      all = leases_prune(leases, details, now)
      if all > 0 then
        return {-2, 'read-write lock'}
      end
    end
    expiry = all > 0 and redis.call('ZSCORE', leases, token)
  end
else
  expiry = redis.pcall('ZSCORE', leases, token)
  if wrongtype(expiry) then
    return {-2, 'lock'}
  end
end

-- Ours already: a reentrant read, or the reply to an earlier try was lost.
local count, fence = lease_mine(leases, details, token, now, expiry)
if count > 0 then
  if mode == 'r' then
    count = lease_recount(details, token, 1)
  end
  lease_extend(leases, details, token, ttl, now, false)
  if wait >= 0 then
    redis.call('ZREM', waiting, waiter)
  end
  return {1, fence, count}
end

-- Fewer leases than the limit, even counting expired ones: no need to look for those (they
-- are dropped once they could stand in anyone's way).
local used = mode == 's' and all or limit
if used >= limit then
  used = leases_prune(leases, details, now)
end
local fresh = mode == 's' and used == 0 -- no live lease: keys just made get the TTL at once
-- A read-write lock's try on a name with live leases: a semaphore's? (One HGET, only when
-- leases live; HMGET with the writer's would save nothing a Redis user's ACL must allow.)
if mode ~= 's' and used > 0 and redis.call('HGET', details, ':kind') == 's' then
  return {-2, 'semaphore'}
end
if mode == 'w' and reader ~= '' and lease_mine(leases, details, reader, now) > 0 then
  return {-3}
end
local queued = redis.call('EXISTS', queue) == 1
-- A take that wakes or stands others down (a registered waiter's, a reader's, a queued
-- name's) publishes after its writes: where anyone else waits (or listens on the release
-- channel), the ACL is asked first (may_publish).
if (wait >= 0 or mode == 'r' or queued) and (queued or announces(channel, inbox)
    or redis.call('EXISTS', writers) == 1 or redis.call('ZCARD', waiting)
      > ((wait >= 0 and redis.call('ZSCORE', waiting, waiter)) and 1 or 0)) then
  may_publish(inbox, announces(channel, inbox) and channel)
end
local took -- a registered waiter's take: the waiter after it stands down (wait_took, below)
if mode == 's' and used < limit and not queued then -- new grants obey the latest limit
  fence = lease_take(leases, details, counter, token, ttl, meta, mode, now, fresh, ':limit',
                     limit, ':kind', 's')
  if wait < 0 then
    return {1, fence, 1}
  end
  took = {1, fence, 1}
end
--! include _wake
--! include _queue
--! include _permits_wake
if took then
  wait_took(waiting, waiter, inbox, true)
  return took
end
local writers_ahead = mode ~= 's' and writers_waiting(writers, now) or 0
local head = false
if queued then
  queue_prune(queue, deadlines, now, fair and waiter) -- (the trier tries now)
  head = redis.call('LINDEX', queue, 0)
end

local free
if mode == 's' then
  free = used < limit and (not head or (fair and head == waiter))
elseif mode == 'r' then
  free = writers_ahead == 0 and not writer_holds(leases, details, now)
else
  free = used == 0
end

if free then
  local prior = ''
  if mode == 's' then -- new grants obey the latest limit
    fence = lease_take(leases, details, counter, token, ttl, meta, mode, now, fresh, ':limit',
                       limit, ':kind', 's')
  elseif mode == 'w' then
    fence, prior = lease_take(leases, details, counter, token, ttl, meta, mode, now, false, ':writer',
                       token, ':kind', 'rw')
    redis.call('ZREM', writers, waiter)
  else
    fence = lease_take(leases, details, counter, token, ttl, meta, mode, now, false, ':kind',
                       'rw')
  end
  if head and head == waiter then
    redis.call('LPOP', queue)
    redis.call('ZREM', deadlines, waiter)
  end
  if wait >= 0 and mode == 's' then
    wait_took(waiting, waiter, inbox, true)
  elseif wait >= 0 then
    redis.call('ZREM', waiting, waiter)
  end
  -- A release woke one waiter per lease it freed; only waiters it could not name are woken
  -- here, one at a time, while leases are left: the readers behind a writer, and the fair
  -- queue's next head (a release woke the head, and the head stays the head until it takes).
  if mode == 'r' or head then
    leases_wake(leases, details, channel, waiting, queue, deadlines, writers, inbox, now)
  end
  return {1, fence, 1, prior}
end

-- Wait. A writer keeps a lease on its place (new readers are refused while it lives), a
-- fair waiter its place in the queue, a plain waiter registers to be woken.
if wait >= 0 then
  if mode == 'w' then
    lease_join(writers, waiter, now + wait, now)
  elseif mode == 's' and fair then
    queue_join(queue, deadlines, waiter, now, wait)
  end
end
-- Sleep at most until the first lease expires, or the first waiter ahead may have died.
local hint = -1
local first = redis.call('ZRANGE', leases, 0, 0, 'WITHSCORES')[2]
if first then
  hint = math.max(0, tonumber(first) - now) -- expired ones left (pruning is bounded): now
end
local ahead = false
if head and head ~= waiter then
  ahead = redis.call('ZSCORE', deadlines, head)
elseif mode == 'r' and writers_ahead > 0 then
  ahead = redis.call('ZRANGE', writers, 0, 0, 'WITHSCORES')[2]
end
if ahead then
  local until_ahead = math.max(0, tonumber(ahead) - now)
  if hint < 0 or until_ahead < hint then
    hint = until_ahead
  end
end
if wait >= 0 and not (mode == 'w' or (mode == 's' and fair)) then
  wait_register(waiting, waiter, now, hint)
end
return {0, hint}
