-- Helpers for fair locks, spliced into scripts by `--! include _queue` (after _wake).
-- Waiters queue in arrival order in a list; each one's deadline (server ms) is in a sorted
-- set. A waiter that gave up or died is dropped once its deadline passes and it stands at
-- the head: only the head's turn matters, and the rest are dropped as they reach it. So no
-- dead waiter blocks the queue past its deadline, and pruning costs O(1) per dead waiter.
local PRUNE_MAX = 100 -- per call: a crowd of dead waiters never blocks Redis for long

local function queue_prune(queue, deadlines, now)
  for _ = 1, PRUNE_MAX do
    local head = redis.call('LINDEX', queue, 0)
    if not head then
      return
    end
    local deadline = tonumber(redis.call('ZSCORE', deadlines, head))
    if deadline and deadline > now then
      return
    end
    redis.call('LPOP', queue)
    redis.call('ZREM', deadlines, head)
  end
end

-- Wake only the waiter whose turn it is, in its process's inbox (no thundering herd). A head
-- nobody hears (its process died: no subscriber, PUBLISH counts 0) is dropped and the next
-- one woken, as wake_first does: else it would hold the queue until its deadline. (A live
-- waiter dropped so, its process reconnecting, queues again at its next try.) A count that
-- is not all of them (classic PUBLISH on a cluster counts one node's subscribers) drops
-- nobody: the head may hear it elsewhere, and keeps its place.
local function queue_wake_head(queue, deadlines, inbox)
  for _ = 1, PRUNE_MAX do
    local head = redis.call('LINDEX', queue, 0)
    if not head then
      return head
    end
    local count, sure = publish(inbox, head)
    if count > 0 or not sure then
      return head
    end
    redis.call('LPOP', queue)
    redis.call('ZREM', deadlines, head)
  end
  return redis.call('LINDEX', queue, 0)
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
local function lock_wake(waiting, queue, deadlines, inbox)
  wake_first(waiting, inbox)
  if redis.call('EXISTS', queue) == 1 then
    queue_prune(queue, deadlines, now_ms())
    queue_wake_head(queue, deadlines, inbox)
  end
end
