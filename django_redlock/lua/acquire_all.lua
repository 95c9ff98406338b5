-- Take several plain locks at once on one server (lock_all): every name, or none.
-- KEYS: five per name, the names in canonical order: lock, fence counter, queue, deadlines,
--       plain waiters; then the set's hand-back marker (the token's, at the first name: see
--       release_all.lua).
-- ARGV: token (the same for every name), ttl ms, holder metadata, waiter id ('': a one-off
--       try that never registers), inbox channel prefix.
-- Returns {1, fence of name 1, ..., fence of name n, then for each name the token of the hold
-- given a fence before it ('': unknown, or held already)} when the caller holds every name, else
-- {0, i, ms until name i may change (-1: wait for a message)}, the caller then holding none;
-- {-2, i, kind} when live leases of another kind hold name i (other_kind in _hold.lua),
-- the caller then holding none; {0, 1, -1} when the token was handed back (its marker is
-- there: the give-back, on another connection, overtook this try on the wire): nothing taken,
-- nothing registered (see acquire.lua).
-- A name held with the token already (an earlier try whose reply was lost took it) counts as
-- taken. A waiter registers on the first busy name only; a release of it wakes the waiter
-- (lua/_wake.lua), which tries the whole set again. Nothing is held while waiting, so two
-- callers with overlapping sets never wait for each other in a cycle.
-- The helpers for waiting are spliced in after a one-off try's take has returned. A
-- registered waiter's take tells the next waiters of the name it waited on to stand down, as
-- acquire.lua's does (the bounded hand-off: HAND_OFF_MS in _wake.lua).
--! include _may_publish
--! include _hold
local token, ttl, meta, waiter, inbox = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local n = math.floor(#KEYS / 5)
local back = KEYS[5 * n + 1]
-- A waiter's try looks first (it would register); a one-off try's look shares the first
-- free name's EXISTS (the common case pays nothing more).
if back and waiter ~= '' and redis.call('EXISTS', back) == 1 then
  return {0, 1, -1}
end
local now = now_ms()
local busy, clash
local fences, priors = {}, {}
for i = 1, n do
  local lock = KEYS[5 * i - 4]
  if redis.call('EXISTS', lock) == 1 then
    local count, fence, wrong = hold_mine(lock, token, 'string')
    local other, dropped = false, false
    if wrong then
      other, dropped = other_kind(lock, now)
    end
    if other then
      clash = clash or {i, other}
    elseif count > 0 then
      fences[i] = fence
    elseif not dropped then -- (a set of expired leases was: the name is free)
      busy = busy or i
    end
  elseif redis.call('EXISTS', KEYS[5 * i - 2], i == 1 and back or KEYS[5 * i - 2]) > 0 then
    if i == 1 and back and waiter == '' and redis.call('EXISTS', back) == 1 then
      return {0, 1, -1}
    end
    busy = busy or i -- free, but a fair queue waits for it: its head goes first
  end
end
if clash then
  busy = clash[1] -- no wait: the caller raises, holding none
end

-- A waiter's take stands others down, a busy name's try frees what it took and wakes:
-- both publish after their writes, so the ACL is asked first (may_publish).
if waiter ~= '' or busy then
  may_publish(inbox)
end
local took
if not busy then
  for i = 1, n do
    local base = 5 * i - 5
    priors[i] = ''
    if fences[i] then
      redis.call('PEXPIRE', KEYS[base + 1], ttl)
    else
      fences[i], priors[i] = hold_take(KEYS[base + 1], KEYS[base + 2], token, ttl, meta, false,
                                       now)
    end
  end
  for i = 1, n do
    fences[n + i] = priors[i]
  end
  if waiter == '' then
    return {1, unpack(fences)}
  end
  took = {1, unpack(fences)}
end

--! include _wake
--! include _queue

if took then
  -- The waiter leaves every name's waiters' set; where it had a place (the name whose
  -- release woke it), those told to stand by at that release stand down (wait_took): a bare
  -- ZREM left the next waiter's timer armed, a try 500 ms later that could not succeed.
  for i = 1, n do
    wait_took(KEYS[5 * i], waiter, inbox)
  end
  return took
end

-- Not all free: hold none. A name of ours (a lost reply's) is let go; a name this waiter
-- was registered on and that is free now passes the wake-up on to its next waiter.
for i = 1, n do
  if i ~= busy then
    local base = 5 * i - 5
    local lock, queue, deadlines, waiting = KEYS[base + 1], KEYS[base + 3], KEYS[base + 4],
                                            KEYS[base + 5]
    local freed = false
    if fences[i] then
      redis.call('DEL', lock)
      freed = true
    end
    if waiter ~= '' and redis.call('ZREM', waiting, waiter) == 1 then
      freed = freed or redis.call('EXISTS', lock) == 0
    end
    if freed then
      lock_wake(waiting, queue, deadlines, inbox)
    end
  end
end

local base = 5 * busy - 5
if clash then
  if waiter ~= '' then
    redis.call('ZREM', KEYS[base + 5], waiter)
  end
  return {-2, busy, clash[2]}
end
local hint = redis.call('PTTL', KEYS[base + 1])
if hint < 0 then
  -- Free but queued for: sleep at most until the queue's head's place lapses.
  local queue, deadlines = KEYS[base + 3], KEYS[base + 4]
  queue_prune(queue, deadlines, now)
  local head = redis.call('LINDEX', queue, 0)
  hint = 0
  if head then
    hint = math.max(0, (tonumber(redis.call('ZSCORE', deadlines, head)) or now) - now)
  end
end
if waiter ~= '' then
  wait_register(KEYS[base + 5], waiter, now, hint)
end
return {0, busy, hint}
