-- Helpers for fair locks, spliced into scripts by `--! include _queue` (after _wake).
-- Waiters queue in arrival order in a list; each one's deadline (server ms) is in a sorted
-- set. A waiter that gave up or died is dropped once its deadline passes, by every script
-- that touches the queue, so it can never block the queue for longer than that.

local function queue_prune(queue, deadlines, now)
  local stale = redis.call('ZRANGEBYSCORE', deadlines, '-inf', now)
  for _, waiter in ipairs(stale) do
    redis.call('LREM', queue, 0, waiter)
  end
  if #stale > 0 then
    redis.call('ZREMRANGEBYSCORE', deadlines, '-inf', now)
  end
end

-- Wake only the waiter whose turn it is, in its process's inbox (no thundering herd).
local function queue_wake_head(queue, inbox)
  local head = redis.call('LINDEX', queue, 0)
  if head then
    redis.call('PUBLISH', inbox_of(inbox, head), head)
  end
  return head
end
