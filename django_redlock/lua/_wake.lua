-- Waking waiters, spliced into scripts by `--! include _wake` (after _may_publish).
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
-- PUBLISH to '<prefix><process id>'. `message`: what is sent (the waiter's id when left out:
-- a wake-up; see HAND_OFF_MS for the others). Returns the receivers counted, and whether that
-- count is all of them: a classic PUBLISH on a cluster reaches subscribers on every node but
-- counts this node's only.
local function publish(inbox, waiter, message)
  message = message or waiter
  if string.byte(inbox, -1) ~= 42 then
    return publish_call('PUBLISH', inbox .. string.match(waiter, '^[^.]*'), message), true
  end
  if string.byte(waiter, 1) == 33 then -- '!'
    local classic = string.match(inbox, '^[^{]*') .. 'inbox:' .. string.match(waiter, '^!([^.]*)')
    return publish_call('PUBLISH', classic, message), false
  end
  if not redis.REDIS_VERSION_NUM then -- Redis 6 (no SPUBLISH): no sharded listener here
    return 0, true
  end
  return publish_call('SPUBLISH', inbox .. string.match(waiter, '^[^.]*'), message), true
end

-- The bounded hand-off. A waiter woken at a release may not take the lock: its process is
-- paused (SIGSTOP, a long GC, a frozen container) yet its socket still counts as a receiver.
-- So a release that wakes one waiter while others wait also tells the first waiter of each
-- other process behind it to stand by, one HAND_OFF_MS apart: '<id>|s<ms>'. Its process
-- wakes it so many ms later (its hub's timer), unless it hears '<id>|d' first: a waiter's
-- take sends that to those (wait_took, queue_took). The chain is told at once: a stand-by
-- sent to a paused process never fires, and nobody else would run a script to tell the next.
-- A live hand-off costs no try more; a paused one costs the next waiter
-- HAND_OFF_MS, not the hold's TTL. 500 ms: some 300 times a loaded machine's hand-off
-- (make bench: p99 1-2 ms on 2 shared cores), so a live waiter slowed by load or a GC
-- normally takes within it; a waiter later than that lets the next one try (a plain lock
-- promises no order; a fair queue's late head queues again, at the back).
local HAND_OFF_MS = 500

-- At most so many processes told per call past the woken one (others' first waiters told to
-- stand by, dead ones dropped; uncounted ones woken): a crowd never blocks Redis for long.
local UNCOUNTED_MAX = 32

-- At most so many waiters looked at per call for those to tell: the waiters of a process told
-- already are passed over uncounted, so a paused process's crowd (a worker's many threads)
-- does not hide the live waiter behind it; past this many, a waiter sleeps to its hint.
local LOOK_MAX = 256

-- At most so many waiters of the woken one's own process told to stand by, one HAND_OFF_MS
-- apart in line order: its waiters may be paused one by one while it runs (an event loop
-- kept busy by sync code pauses its tasks, not the process's threads), and a live one
-- behind them must not sleep to its hint. Another process is told once (paused, all of its
-- waiters are).
local OWN_MAX = 2

-- A waiter's process: its id up to the '.' ('!' included: the same process's ids all have it
-- or none do).
local function process_of(waiter)
  return string.match(waiter, '^[^.]*')
end

-- Tell `waiter` to stand by for `ms` (see HAND_OFF_MS): the receivers counted, and whether
-- that is all.
local function stand_by(inbox, waiter, ms)
  return publish(inbox, waiter, waiter .. '|s' .. (ms or HAND_OFF_MS))
end

-- A plain lock's waiters (a sorted set) read by place, 64 at a time: a crowd costs one call
-- per 64 looked at. Returns entry(at) (nil past the end) and drop(at, id), which removes one.
local function zset_line(set)
  local base, chunk = 0, {}
  local function entry(at)
    if at < base or at >= base + #chunk then
      base, chunk = at, redis.call('ZRANGE', set, at, at + 63)
    end
    return chunk[at - base + 1]
  end
  local function drop(_, id)
    redis.call('ZREM', set, id)
    chunk = {} -- the places after it moved
  end
  return entry, drop
end

-- The stand-bys of a hand-off, from place `at` of a line (entry, drop as zset_line's): the
-- woken process's next waiters, the k-th at k * HAND_OFF_MS (OWN_MAX of them), and the first
-- waiter of each other process, the k-th at `ms` + k * HAND_OFF_MS (a dead one, nobody
-- hearing, is dropped and the next told). Another process told is not told again: its other
-- waiters are passed over.
local function stand_bys(inbox, woken, entry, drop, at, ms)
  local told, counted, own = {}, 0, 0
  for _ = 1, LOOK_MAX do
    local after = counted < UNCOUNTED_MAX and entry(at)
    if not after then
      return
    end
    local process = process_of(after)
    if process == woken then
      if own < OWN_MAX then
        own = own + 1
        stand_by(inbox, after, own * HAND_OFF_MS)
      end
      at = at + 1
    elseif told[process] then
      at = at + 1
    else
      counted = counted + 1
      local count, sure = stand_by(inbox, after, ms + HAND_OFF_MS)
      if count > 0 or not sure then
        told[process], ms, at = true, ms + HAND_OFF_MS, at + 1
      else
        drop(at, after)
      end
    end
  end
end

-- Tell those a release may have told to stand by to stand down, `entry(at)` the line by place
-- from its first: the two first, the first waiter of each process, and the first OWN_MAX of
-- the woken one's process (`taker`'s, the one that took, or the first's in line: it woke,
-- paused, and did not take), as far as stand_bys looks. One message per waiter told, as the
-- stand-bys were: a taken hand-off costs no try more.
local function stand_down(inbox, entry, taker)
  local seen, processes = {}, 0
  local first = entry(0)
  local woken = { [first and process_of(first) or ''] = true }
  if taker then
    woken[process_of(taker)] = true
  end
  for at = 0, LOOK_MAX - 1 do
    local id = processes <= UNCOUNTED_MAX and entry(at)
    if not id then
      return
    end
    local process = process_of(id)
    local count = seen[process] or 0
    if at < 2 or count == 0 or (woken[process] and count <= OWN_MAX) then
      publish(inbox, id, id .. '|d')
    end
    if count == 0 then
      processes = processes + 1
    end
    seen[process] = count + 1
  end
end

-- A registered waiter took the lock: it leaves the set, and those told to stand by at the
-- release (wake_first) stand down: they are woken at the next release instead.
-- `popped`: the taker may have left the set already, at its wake-up (a semaphore's waiter).
local function wait_took(waiting, waiter, inbox, popped)
  local left = redis.call('ZREM', waiting, waiter) == 1
  if (left or popped) and inbox and inbox ~= '' then
    stand_down(inbox, (zset_line(waiting)), waiter)
  end
end

-- A plain lock's waiters register in a sorted set (by arrival) as they try. A release wakes
-- only the earliest, not every process. A process that died has no subscriber left (PUBLISH
-- counts 0): its waiter is dropped and the next one woken. With `pop`, the woken waiter
-- leaves the set too (a semaphore: the next release must wake the next waiter, not it).
-- A classic listener on a cluster counted 0 may be alive elsewhere: it was woken all the
-- same, leaves the set as a dead one would (its try, if it fails, registers it again), and
-- the next one is woken too, up to UNCOUNTED_MAX such waiters per call.
-- With `hand_off`, the waiter after the one heard (the first left, with `pop`) stands by
-- (HAND_OFF_MS), and so does the first waiter of each other process, one HAND_OFF_MS more
-- per process (a dead one is dropped and the next told): a single waiter costs nothing more.
local function wake_first(waiting, inbox, pop, hand_off)
  local uncounted = 0
  local last
  while true do
    local first = redis.call('ZRANGE', waiting, 0, 0)[1]
    if not first then
      return
    end
    last = first
    local count, sure = publish(inbox, first)
    local heard = count > 0
    if pop or not heard then
      redis.call('ZREM', waiting, first)
    end
    if not sure and not heard then
      uncounted = uncounted + 1
    end
    if heard or uncounted >= UNCOUNTED_MAX then
      break
    end
  end
  if not hand_off or uncounted >= UNCOUNTED_MAX then
    return
  end
  -- The next waiter is told, and so is the first waiter of each other process: a paused
  -- process (its socket counted) hears the stand-by for its other waiters too, and the live
  -- waiter behind them would sleep to its hint. (The next is told even of the same process:
  -- a live one's registration whose waiter is gone unknown to its hub, the stand-by is how
  -- the turn goes on.) A paused process costs the next HAND_OFF_MS, then it tries; a live
  -- one's take stands the rest down.
  local entry, drop = zset_line(waiting)
  stand_bys(inbox, process_of(last), entry, drop, pop and 0 or 1, 0)
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
