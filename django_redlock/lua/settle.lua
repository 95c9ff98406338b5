-- Set a reentrant owner's hold count to what its process believes, after a reply was lost
-- and the count may be one too many (an acquire that went through) or too few. Its process
-- counts every hold of the owner (a thread or task of its own), so its count is the truth.
-- 0 frees the lock and wakes its waiters, as a release does. An owner that holds nothing
-- (it expired, or someone else holds the lock) is left alone.
-- KEYS: lock, release channel (the lock's own key where nobody listens there), plain waiters,
--       queue, deadlines[, the owner's hand-back marker].
-- ARGV: owner, count, inbox channel prefix[, the write's number (order_stale in _hold.lua)].
-- Returns the owner's count now (0: none); -3 when the write is older than one the hold
-- applied (it ran late: nothing done).
--! include _may_publish
--! include _hold
--! include _wake
--! include _queue
local lock, owner, count = KEYS[1], ARGV[1], tonumber(ARGV[2])
local channel = KEYS[2] ~= lock and KEYS[2] or ''
local seq = tonumber(ARGV[4])
if hold_mine(lock, owner, 'hash') == 0 then
  local back = KEYS[6]
  if seq and back then
    -- Nothing held as of this write: an older write of the owner's still on the wire (an
    -- interrupted try, this settle its hand-back, sent on another connection) must take
    -- nothing when it lands: acquire.lua refuses the owner's writes up to this one. Kept as
    -- long as release.lua's HANDED_BACK_MS (keep them in step).
    local last = tonumber(redis.call('GET', back))
    if not last or last < seq then
      redis.call('SET', back, string.format('%d', seq), 'PX', 120000)
    end
  end
  return 0
end
if order_stale(lock, seq) then
  return -3
end
if count > 0 then
  if seq then
    redis.call('HSET', lock, owner, count, ':seq', seq)
  else
    redis.call('HSET', lock, owner, count)
  end
  return count
end
if lock_freed(lock, channel, KEYS[3], KEYS[4], ARGV[3]) then
  lock_wake(KEYS[3], KEYS[4], KEYS[5], ARGV[3])
end
return 0
