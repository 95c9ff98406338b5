-- Helpers for fair locks, spliced into scripts by `--! include _queue` (after _wake).
-- Waiters queue in arrival order in a list; each one's deadline (server ms) is in a sorted
-- set. A waiter that gave up or died is dropped once its deadline passes and it stands at
-- the head: only the head's turn matters, and the rest are dropped as they reach it. So no
-- dead waiter blocks the queue past its deadline, and pruning costs O(1) per dead waiter.
local PRUNE_MAX = 100 -- per call: a crowd of dead waiters never blocks Redis for long

-- A head's deadline brought down by a hand-off (queue_wake_head) carries this fraction of a
-- ms (every other deadline is whole ms): a head dropped at such a deadline missed its turn,
-- and the waiters of its process right behind it are dropped with it (that process is paused:
-- they would each hold the queue to their own deadline; live, the one trying keeps its turn,
-- the others queue again at their try).
-- The turn goes on with a bound: the next head's deadline comes down to HAND_OFF_MS after the
-- missed one's, marked so too (the release told it to stand by then: the hand-off chains,
-- as the stand-bys were told, one HAND_OFF_MS apart per process).
local HANDED = 0.25

-- Drop the heads whose deadline passed. `trier`: the waiter whose try prunes; it tries now,
-- live: its turn is not brought down, nor is it dropped with its process's missed head.
local function queue_prune(queue, deadlines, now, trier)
  local missed = {} -- the processes of heads dropped at their hand-off deadline
  local handed -- the last such deadline
  for _ = 1, PRUNE_MAX do
    local head = redis.call('LINDEX', queue, 0)
    if not head then
      return
    end
    local deadline = tonumber(redis.call('ZSCORE', deadlines, head))
    local process = process_of(head)
    if handed and deadline and not missed[process] and head ~= trier then
      local turn = math.floor(math.min(deadline, math.floor(handed) + HAND_OFF_MS)) + HANDED
      if turn ~= deadline then
        deadline = turn
        redis.call('ZADD', deadlines, deadline, head)
      end
    end
    if deadline and deadline > now and (not missed[process] or head == trier) then
      return
    end
    if deadline and deadline % 1 == HANDED and not missed[process] then
      missed[process], handed = true, deadline
    end
    redis.call('LPOP', queue)
    redis.call('ZREM', deadlines, head)
  end
  -- The cap: a head of a missed process left for the next call has missed its turn too, so
  -- its deadline is passed now (the trier's hint is 0: it goes on at once, not at the
  -- paused waiter's own deadline).
  local head = redis.call('LINDEX', queue, 0)
  if head and head ~= trier and missed[process_of(head)] then
    redis.call('ZADD', deadlines, now - 1 + HANDED, head)
  end
end

-- Wake only the waiter whose turn it is, in its process's inbox (no thundering herd). A head
-- nobody hears (its process died: no subscriber, PUBLISH counts 0) is dropped and the next
-- one woken, as wake_first does: else it would hold the queue until its deadline. (A live
-- waiter dropped so, its process reconnecting, queues again at its next try.) A count that
-- is not all of them (classic PUBLISH on a cluster counts one node's subscribers) drops
-- nobody: the head may hear it elsewhere, and keeps its place.
-- With `hand_off` (a lock freed, at server ms `now`) and someone behind the head, the
-- hand-off is bounded (HAND_OFF_MS in _wake.lua): the head's deadline comes
-- down to now + HAND_OFF_MS (a live head takes its turn before; a paused one is dropped by
-- the next try after it), and the next in line stands by, to try then, and so does the first
-- waiter of each other process, one HAND_OFF_MS more per process (a dead one is dropped, the
-- next told): a paused process counts as hearing for all its waiters, and the live waiter
-- behind them would sleep on. Then the head's deadline is marked HANDED: its process's
-- waiters right behind it are dropped with it, and the next head's turn is bounded in turn
-- (queue_prune). `waiting`: the name's plain waiters' set; a plain waiter registered there
-- waits behind the head too, so the bound holds with nobody queued behind it.
local function queue_wake_head(queue, deadlines, inbox, hand_off, now, waiting)
  local head, unheard
  for _ = 1, PRUNE_MAX do
    head = redis.call('LINDEX', queue, 0)
    if not head then
      return head
    end
    local count, sure = publish(inbox, head)
    if count > 0 or not sure then
      break
    end
    redis.call('LPOP', queue)
    redis.call('ZREM', deadlines, head)
    head = nil
  end
  if not head then
    -- PRUNE_MAX dead heads dropped, the cap: the next is woken all the same (nobody else
    -- would wake those behind it), and if nobody hears it either, its turn is over at once.
    head = redis.call('LINDEX', queue, 0)
    if not head then
      return head
    end
    local count, sure = publish(inbox, head)
    unheard = count == 0 and sure
  end
  if not hand_off then
    return head
  end
  local ms = 0
  if unheard then
    -- Dead, kept for the cap: a missed turn (the next try drops it, and its process's
    -- waiters right behind it), and the first of the next process tries at once.
    redis.call('ZADD', deadlines, now - 1 + HANDED, head)
    ms = -HAND_OFF_MS
  end
  local function entry(at)
    return redis.call('LINDEX', queue, at) -- (not LRANGE: the ACL rule names the commands)
  end
  local function drop(_, id)
    redis.call('LREM', queue, 1, id) -- the first of its id from the head: this one
    redis.call('ZREM', deadlines, id)
  end
  stand_bys(inbox, process_of(head), entry, drop, 1, ms)
  local plain = waiting and redis.call('EXISTS', waiting) == 1
  if unheard or (not plain and not redis.call('LINDEX', queue, 1)) then
    return head -- its turn over already, or nobody behind it any more
  end
  local soon = now + HAND_OFF_MS
  local deadline = math.min(tonumber(redis.call('ZSCORE', deadlines, head)) or soon, soon)
  redis.call('ZADD', deadlines, math.floor(deadline) + HANDED, head)
  return head
end

-- A fair waiter at the head took the lock: it leaves the queue, and those told to stand by at
-- the release (queue_wake_head) stand down.
local function queue_took(queue, deadlines, waiter, inbox)
  redis.call('LPOP', queue)
  redis.call('ZREM', deadlines, waiter)
  if inbox then
    stand_down(inbox, function(at)
      return redis.call('LINDEX', queue, at)
    end, waiter)
  end
end

-- A waiter with a lease on its place: `set` maps waiter -> deadline (server ms); the set
-- (and `also`, if given) live as long as the last deadline, plus a second.
local function lease_join(set, waiter, deadline, now, also)
  redis.call('ZADD', set, deadline, waiter)
  local last = redis.call('ZRANGE', set, -1, -1, 'WITHSCORES')
  local keep = math.max(1, tonumber(last[2]) - now + 1000)
  redis.call('PEXPIRE', set, keep)
  if also then
    redis.call('PEXPIRE', also, keep)
  end
end

-- A fair waiter takes its place at the back of the queue, or keeps it, until now + wait.
local function queue_join(queue, deadlines, waiter, now, wait)
  if not redis.call('ZSCORE', deadlines, waiter) then
    redis.call('RPUSH', queue, waiter)
  end
  lease_join(deadlines, waiter, now + wait, now, queue)
end

-- Wake whoever waits for a lock just freed (see lock_freed in _hold.lua): the earliest
-- registered plain waiter, and the head of the fair queue if the name has one (a plain try may
-- have taken a free lock before a fair waiter queued, whatever kind is freed).
-- Either hands off with a bound (HAND_OFF_MS in _wake.lua).
local function lock_wake(waiting, queue, deadlines, inbox)
  wake_first(waiting, inbox, false, true)
  if redis.call('EXISTS', queue) == 1 then
    local now = now_ms()
    queue_prune(queue, deadlines, now)
    queue_wake_head(queue, deadlines, inbox, true, now, waiting)
  end
end
