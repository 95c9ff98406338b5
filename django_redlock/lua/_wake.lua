-- Waking waiters, spliced into scripts by `--! include _wake`.
-- A waiter id is '<process id>.<serial>'; each process reads one inbox channel,
-- '<inbox prefix><process id>', for all its waiters, so waiting costs no SUBSCRIBE per wait.

-- How a waiter is woken, from the inbox prefix the caller passed and the waiter's id: the
-- message (its id) goes where the waiter listens, whichever way the caller's process
-- listens. A cluster's prefix ends with '*' ('<KEY_PREFIX>{tag}:inbox*': no KEY_PREFIX has a
-- glob character or a '{') and carries the lock's hash tag. There a waiter whose id starts
-- with '!' listens on its process's classic inbox, '<KEY_PREFIX>inbox:<process id>' (its
-- process uses classic pub/sub: it found a node below Redis 7, or one did not answer), any
-- other on '<prefix><process id>' with SSUBSCRIBE on the lock's shard (Redis 7+), so SPUBLISH
-- reaches it without crossing the cluster bus. Elsewhere (one server, a Redlock node):
-- PUBLISH to '<prefix><process id>'. Returns the receivers counted, and whether that count
-- is all of them: a classic PUBLISH on a cluster reaches subscribers on every node but
-- counts this node's only.
local function publish(inbox, waiter)
  if string.byte(inbox, -1) ~= 42 then
    return redis.call('PUBLISH', inbox .. string.match(waiter, '^[^.]*'), waiter), true
  end
  if string.byte(waiter, 1) == 33 then -- '!'
    local classic = string.match(inbox, '^[^{]*') .. 'inbox:' .. string.match(waiter, '^!([^.]*)')
    return redis.call('PUBLISH', classic, waiter), false
  end
  if not redis.REDIS_VERSION_NUM then -- Redis 6 (no SPUBLISH): no sharded listener here
    return 0, true
  end
  return redis.call('SPUBLISH', inbox .. string.match(waiter, '^[^.]*'), waiter), true
end

-- A plain lock's waiters register in a sorted set (by arrival) as they try. A release wakes
-- only the earliest, not every process. A process that died has no subscriber left (PUBLISH
-- counts 0): its waiter is dropped and the next one woken. With `pop`, the woken waiter
-- leaves the set too (a semaphore: the next release must wake the next waiter, not it).
-- A classic listener on a cluster counted 0 may be alive elsewhere: it was woken all the
-- same, leaves the set as a dead one would (its try, if it fails, registers it again), and
-- the next one is woken too, up to UNCOUNTED_MAX such waiters per call.
local UNCOUNTED_MAX = 32
local function wake_first(waiting, inbox, pop)
  local uncounted = 0
  while true do
    local first = redis.call('ZRANGE', waiting, 0, 0)[1]
    if not first then
      return
    end
    local count, sure = publish(inbox, first)
    local heard = count > 0
    if pop or not heard then
      redis.call('ZREM', waiting, first)
    end
    if not sure and not heard then
      uncounted = uncounted + 1
    end
    if heard or uncounted >= UNCOUNTED_MAX then
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
