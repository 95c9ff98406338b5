-- Waking waiters, spliced into scripts by `--! include _wake`.
-- A waiter id is '<process id>.<serial>'; each process reads one inbox channel,
-- '<inbox prefix><process id>', for all its waiters, so waiting costs no SUBSCRIBE per wait.

-- PUBLISH, or SPUBLISH on a Redis 7+ cluster (sharded pub/sub: the message stays on the
-- lock's shard instead of crossing the whole cluster bus). The inbox prefix argument says
-- which: a sharded backend's ends with '*' (an unsharded one is '<KEY_PREFIX>inbox:', and no
-- KEY_PREFIX has a glob character) and holds the lock's hash tag, so its inboxes, like the
-- release channel, hash to the lock's slot.
local function publish(inbox, channel, message)
  if string.byte(inbox, -1) == 42 then
    return redis.call('SPUBLISH', channel, message)
  end
  return redis.call('PUBLISH', channel, message)
end

local function inbox_of(inbox, waiter)
  return inbox .. string.match(waiter, '^[^.]*')
end

-- A plain lock's waiters register in a sorted set (by arrival) as they try. A release wakes
-- only the earliest, not every process. A process that died has no subscriber left (PUBLISH
-- counts 0): its waiter is dropped and the next one woken. With `pop`, the woken waiter
-- leaves the set too (a semaphore: the next release must wake the next waiter, not it).
local function wake_first(waiting, inbox, pop)
  while true do
    local first = redis.call('ZRANGE', waiting, 0, 0)[1]
    if not first then
      return
    end
    local heard = publish(inbox, inbox_of(inbox, first), first) > 0
    if pop or not heard then
      redis.call('ZREM', waiting, first)
    end
    if heard then
      return
    end
  end
end

-- A plain waiter that tried and failed keeps (or takes) its place. The set outlives every
-- registered waiter's sleep: they sleep at most until the lock's expiry, then try again.
-- The score is the arrival (server ms; inspect's longest wait), but never below the last
-- waiter's: after the server's clock stepped back, a later waiter still sorts after every
-- earlier one (a us above, written as text: Lua's own conversion keeps 14 digits).
local function wait_register(waiting, waiter, now, pttl)
  if not redis.call('ZSCORE', waiting, waiter) then
    local last = redis.call('ZRANGE', waiting, -1, -1, 'WITHSCORES')[2]
    local score = last and math.max(now, tonumber(last) + 0.001) or now
    redis.call('ZADD', waiting, string.format('%.3f', score), waiter)
  end
  local keep = math.max(pttl, 0) + 1000
  if redis.call('PTTL', waiting) < keep then
    redis.call('PEXPIRE', waiting, keep)
  end
end
