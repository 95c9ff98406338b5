-- Release one hold of each of several locks on one server (lock_all's release), each as
-- release.lua releases one, in one call: a lock freed wakes its waiters.
-- KEYS: five per lock, as release.lua's: lock, release channel (the lock's own key where
--       nobody listens there), plain waiters, queue, deadlines[, lock_all's hand-back marker:
--       given by the give-back of a take that may be on the wire; the token holding none of
--       the locks, it is marked, and acquire_all.lua refuses that take when it lands (as
--       release.lua marks a lock's token)].
-- ARGV: three per lock, as release.lua's: token, inbox channel prefix, the hold's kind ('0'
--       plain, '1' reentrant, '': looked up).
-- Returns each lock's answer as release.lua gives it: the holds left (0: freed), or -1 when
-- the caller holds none (not ours, or lost).
--! include _may_publish
--! include _hold
--! include _wake
--! include _queue
-- The ACL asked before the first lock is touched (may_publish): a refusal at a later lock
-- must not come after an earlier one was freed.
local n = math.floor(#KEYS / 5)
for i = 1, n do
  local lock, channel = KEYS[5 * i - 4], KEYS[5 * i - 3]
  channel = channel ~= lock and channel or ''
  local inbox = ARGV[3 * i - 1]
  local announce = announces(channel, inbox)
  if announce or redis.call('EXISTS', KEYS[5 * i - 2], KEYS[5 * i - 1]) > 0 then
    may_publish(inbox, announce and channel)
  end
end
local results, held = {}, false
for i = 1, n do
  local lock, channel, waiting = KEYS[5 * i - 4], KEYS[5 * i - 3], KEYS[5 * i - 2]
  local queue, deadlines = KEYS[5 * i - 1], KEYS[5 * i]
  if channel == lock then
    channel = ''
  end
  local token, inbox, kind = ARGV[3 * i - 2], ARGV[3 * i - 1], ARGV[3 * i]
  local count = hold_mine(lock, token, kind == '1' and 'hash' or kind == '0' and 'string' or nil)
  held = held or count > 0
  if count == 0 then
    results[i] = -1
  elseif count > 1 then
    redis.call('HSET', lock, token, count - 1)
    results[i] = count - 1
  else
    if lock_freed(lock, channel, waiting, queue, inbox) then
      lock_wake(waiting, queue, deadlines, inbox)
    end
    results[i] = 0
  end
end
local back = KEYS[5 * n + 1]
if back and not held then -- as long as release.lua's HANDED_BACK_MS (keep them in step)
  redis.call('SET', back, '1', 'PX', 120000)
end
return results
