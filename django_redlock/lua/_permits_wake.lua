-- Waking for semaphores and read-write locks, spliced in by `--! include _permits_wake`
-- (after _hold, _wake, _queue and _permits).

-- Wake whoever can take a lease now, one waiter per free lease (the woken one leaves the
-- plain waiters' set, so the next release wakes the next one), never a herd: a waiting
-- writer when nobody holds, else none while a writer holds or waits; else (a permit free)
-- the fair queue's head or the earliest plain waiter. Waiters on the release channel
-- (see announces in _hold.lua) hear it there. `mode`: 's' when a
-- semaphore's permit was freed (no writers to look for), else nil.
local function leases_wake(leases, details, channel, waiting, queue, deadlines, writers, inbox, now,
                           mode)
  local used = redis.pcall('ZCOUNT', leases, '(' .. ms_text(now), '+inf')
  if wrongtype(used) then
    return -- a lock of another kind holds the name: its release wakes its waiters
  end
  if mode ~= 's' then
    if writers_waiting(writers, now) > 0 then
      if used == 0 then -- the first writer (by deadline) only; a dead one's lease runs out
        if announces(channel, inbox) then
          publish_call('PUBLISH', channel, 'released')
        end
        local first = redis.call('ZRANGE', writers, 0, 0)[1]
        publish(inbox, first)
      end
      return
    end
    if writer_holds(leases, details, now) then
      return
    end
  end
  local limit = tonumber(redis.call('HGET', details, ':limit'))
  if limit and used >= limit then
    return
  end
  if announces(channel, inbox) then
    publish_call('PUBLISH', channel, 'released')
  end
  if redis.call('EXISTS', queue) == 1 then
    queue_prune(queue, deadlines, now)
    queue_wake_head(queue, deadlines, inbox)
  else
    wake_first(waiting, inbox, true, mode == 's') -- a permit freed: handed off with a bound
  end
end
