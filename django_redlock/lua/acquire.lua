-- Acquire a lock of any kind in one atomic step.
-- KEYS: lock, fence counter, queue, deadlines, plain waiters
--       [, hand-back marker (the token's: a plain or fair one's is written by release.lua,
--       a reentrant owner's by settle.lua)[, node marker (Redlock's restart guard)]].
-- ARGV: token, ttl ms, holder metadata, reentrant ('0': plain; '1', or a reentrant owner's
--       ordered write 'seq|levels': its number and the levels the owner holds before it, see
--       order_stale in _hold.lua), fair ('1'/'0'),
--       [waiter id, wait ms (-1: a one-off try that never queues or registers),
--       inbox channel prefix: all three left out for a one-off try],
--       [restart guard ms, last, with the node marker].
-- Returns {1, fence, hold count, token of the hold given a fence before this one ('':
-- unknown, or a re-entry)} when held by the caller, else {0, ms until something may change
-- (-1: unknown, wait for a message)}; {-2, kind} when live leases of another kind
-- (a semaphore, a read-write lock) hold the name (see other_kind in _hold.lua); {-3} when an
-- ordered write is older than one the hold applied (it ran late: nothing done); {-4} when an
-- ordered re-entry (levels > 0) finds no hold of the owner's: the hold it nests in is gone,
-- and nothing is taken; {0, -1} when the token was handed back (its marker is there):
-- nothing taken, nothing registered or queued; {-3} too when a reentrant owner's ordered
-- write is not newer than the write its marker holds (a settle that found nothing held).
-- A hand-back may precede the try it hands back: the try was delayed on the wire when its
-- caller was cancelled or interrupted, and the clean-up's release, on another connection,
-- got there first, found nothing to release and left the marker. Granted now, the hold would
-- be nobody's until its TTL: the marker settles the order.
-- The common case (a plain lock, free, nobody queued, a one-off try: 5 arguments)
-- runs first, flat, before any helper is defined: `--! include _hold` builds a closure per
-- helper on every call, which cost that case more than its commands (issue 46). It does
-- what hold_take and fence_next in _hold.lua do (keep them in step); anything else (a held
-- lock, a queue, a hand-back marker) goes on below with what it read (the clock, EXISTS).
-- The helpers for waiting and queueing are spliced in after that: taking a free lock never
-- defines them.
-- A registered waiter's or a queue head's take tells the next waiter to stand down (the
-- bounded hand-off: HAND_OFF_MS in _wake.lua).
local lock, counter, queue, deadlines = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local waiting, back, marker = KEYS[5], KEYS[6], KEYS[7]
local token, ttl, meta = ARGV[1], ARGV[2], ARGV[3]
local plain_try = #ARGV == 5 and not marker and ARGV[4] == '0' and ARGV[5] == '0'
local clock, queued, handed
if plain_try then
  clock = redis.call('TIME')
  -- A name whose fair queue has waiters is taken in queue order, whatever kind tries. One
  -- EXISTS for the queue and the hand-back marker (rare): either sends the try on below.
  if redis.call('EXISTS', queue, back or queue) == 0 then
    queued, handed = false, false
    -- The next fence: above the counter ('fence|token', or a bare 'fence'), at least the
    -- clock in us; integer text (a Lua number as text would be '1.76e+15').
    local last, prior = 0, ''
    local value = redis.call('GET', counter)
    if value then
      local fence, who = string.match(value, '^(%d+)|?(.*)$')
      last, prior = tonumber(fence) or 0, who or ''
    end
    local fence = math.max(last + 1, clock[1] * 1000000 + clock[2])
    local text = string.format('%d', fence)
    local at = string.format('%d', clock[1] * 1000 + math.floor(clock[2] / 1000))
    if redis.call('SET', lock, token .. '|' .. text .. '|' .. at .. '|' .. meta,
                  'NX', 'PX', ttl) then
      -- Kept FENCE_MEMORY_MS (_hold.lua) at least.
      redis.call('SET', counter, text .. '|' .. token, 'PX', math.max(tonumber(ttl), 60000))
      return {1, fence, 1, prior}
    end
  end
end
if back and ARGV[4] == '0' then
  if handed == nil then
    handed = redis.call('EXISTS', back) == 1
  end
  if handed then
    -- Left to its TTL: a second late try of the token (one kept after an unanswered try)
    -- is refused too.
    return {0, -1}
  end
elseif back then
  -- A reentrant owner's token is itself, taken again later: only its older writes are
  -- refused, as order_stale refuses them where the hold is there.
  local seq = tonumber(string.match(ARGV[4], '^(%d+)|'))
  local last = seq and tonumber(redis.call('GET', back))
  if last and seq <= last then
    return {-3}
  end
end
--! include _may_publish
--! include _hold
local reentrant, fair = ARGV[4] ~= '0', ARGV[5] == '1'
local seq, levels = order_read(ARGV[4])
local given = #ARGV
local guard = 0
if marker then
  guard, given = tonumber(ARGV[given]) or 0, given - 1
end
local waiter, wait, inbox = token, -1, nil
if given >= 7 then
  waiter, wait, inbox = ARGV[6], tonumber(ARGV[7]), ARGV[8]
end
local registered = not fair and wait >= 0 -- a plain waiter: registered to be woken
local now = now_ms(clock)

--! include _restart_guard

if queued == nil then
  -- A name whose fair queue has waiters is taken in queue order, whatever kind tries.
  queued = redis.call('EXISTS', queue) == 1
end
-- A take that stands others down (wait_took: a registered waiter with others in the set;
-- queue_took: a fair waiter in a queue) publishes after it wrote: the ACL is asked first
-- (may_publish). A try that stands nobody down is not asked (a waiter alone, a one-off try).
if inbox and inbox ~= '' and ((fair and queued) or (registered
    and redis.call('ZSCORE', waiting, waiter) and redis.call('ZCARD', waiting) > 1)) then
  may_publish(inbox)
end

-- Plain and not fair: the classic SET NX PX, tried first (a one-off try's was, above). Taken
-- by a registered waiter: the waiters' set is seen to below (wait_took, once the helpers are
-- in).
local took
if not reentrant and not fair and not queued and not plain_try then
  local fence, prior = hold_take(lock, counter, token, ttl, meta, false, now)
  if fence then
    if not registered then
      return {1, fence, 1, prior}
    end
    took = {1, fence, 1, prior}
  end
end
--! include _wake
--! include _queue
if took then
  wait_took(waiting, waiter, inbox)
  return took
end

-- Ours already: a re-entry, or the reply to an earlier try was lost.
local count, fence, wrong = hold_mine(lock, token, reentrant and 'hash' or 'string')
local dropped = false
if wrong then
  local other
  other, dropped = other_kind(lock, now)
  if other then
    return {-2, other}
  end
end
if count > 0 then
  if seq then
    -- Ordered: the owner's levels + 1, whatever a late write or a lost reply left here.
    if order_stale(lock, seq) then
      return {-3}
    end
    count = levels + 1
    redis.call('HSET', lock, token, count, ':seq', seq)
  elseif reentrant then
    count = count + 1
    redis.call('HSET', lock, token, count)
  end
  redis.call('PEXPIRE', lock, ttl)
  if registered then
    wait_took(waiting, waiter, inbox)
  end
  return {1, fence, count}
end
-- A re-entry whose hold is gone (expired; a late one after the owner's release) takes nothing:
-- a new hold would be counted as the old one, and the owner's release would free it as if
-- the old one had never been lost.
if levels and levels > 0 then
  return {-4}
end

if not fair and not queued then
  -- A plain lock was tried above already: its SET NX found it held.
  -- (again, for a plain lock, when other_kind dropped a set of expired leases)
  local prior
  if reentrant or dropped then
    fence, prior = hold_take(lock, counter, token, ttl, meta, reentrant and (seq or true), now)
  end
  if fence then
    if registered then
      wait_took(waiting, waiter, inbox)
    end
    return {1, fence, 1, prior}
  end
  local pttl = redis.call('PTTL', lock)
  if registered then
    wait_register(waiting, waiter, now, pttl)
  end
  return {0, pttl}
end

-- Queue order: the lock goes to the head of the queue, or to anyone when nobody queues.
-- A fair waiter queues; any other try only takes a lock that nobody queues for.
queue_prune(queue, deadlines, now, fair and waiter) -- (the trier tries now)
local head = redis.call('LINDEX', queue, 0)
if (not head or (fair and head == waiter)) and redis.call('EXISTS', lock) == 0 then
  local prior
  fence, prior = hold_take(lock, counter, token, ttl, meta, reentrant and (seq or true), now)
  if head then
    queue_took(queue, deadlines, waiter, inbox)
  end
  if registered then
    wait_took(waiting, waiter, inbox)
  end
  return {1, fence, 1, prior}
end
if fair and wait >= 0 then
  queue_join(queue, deadlines, waiter, now, wait)
  head = head or waiter
end
-- Sleep at most until the lock expires, or until the head's deadline (it may have died).
local hint = redis.call('PTTL', lock)
if head and head ~= waiter then
  local until_head = math.max(0, (tonumber(redis.call('ZSCORE', deadlines, head)) or now) - now)
  if hint < 0 or until_head < hint then
    hint = until_head
  end
end
if hint == -2 then
  hint = 0
end
if registered then
  wait_register(waiting, waiter, now, hint)
end
return {0, hint}
