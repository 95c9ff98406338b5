-- Release one hold of a lease (a permit, a read or a write); free the lease when none are
-- left, and wake as many waiters as can now take one (see leases_wake).
-- KEYS: leases, details, release channel (the leases' own key where nobody listens there),
--       plain waiters, queue, deadlines, waiting writers[, hand-back marker: given by a
--       permit's or a write's hand-back, whose token holding nothing is marked (as
--       release.lua marks a lock's: see there, and permit_acquire.lua)].
-- ARGV: token, inbox channel prefix[, the mode it was taken in: 's', 'r' or 'w' (absent:
--       read from its details)][, '1' with the marker: the token was kept from an
--       unanswered try, marked once freed here too].
-- Returns the holds left (0: freed), or -1 when the caller holds none (not ours, or lost).
-- The waking helpers are spliced in after the common case has returned: nobody registered,
-- queued or waiting to write (none of their keys exists), nobody on the release channel.
--! include _may_publish
--! include _hold
--! include _permits
local leases, details, channel = KEYS[1], KEYS[2], KEYS[3]
if channel == leases then
  channel = ''
end
local token, inbox = ARGV[1], ARGV[2]
local now = now_ms()
local expiry = redis.pcall('ZSCORE', leases, token)
local back = KEYS[8]
if wrongtype(expiry) then -- the name is a lock's now: this lease is long gone
  return -1
end
local count, _, mode = lease_mine(leases, details, token, now, expiry, ARGV[3])
if count == 0 then
  if back then -- as long as release.lua's HANDED_BACK_MS (keep them in step)
    redis.call('SET', back, '1', 'PX', 120000)
  end
  return -1
end
if count > 1 then
  return lease_recount(details, token, -1)
end
local quiet = channel == '' and redis.call('EXISTS', KEYS[4], KEYS[5], KEYS[7]) == 0
if not quiet then -- leases_wake below publishes after the writes: the ACL asked first
  may_publish(inbox, announces(channel, inbox) and channel)
end
redis.call('ZREM', leases, token)
if back and ARGV[4] then
  redis.call('SET', back, '1', 'PX', 120000)
end
if quiet then
  if redis.call('ZCARD', leases) == 0 then -- the details go with the last lease
    redis.call('DEL', details)
  else
    if mode == 'w' then
      redis.call('HDEL', details, token, ':writer')
    else
      redis.call('HDEL', details, token)
    end
    leases_trim(leases, details, now, expiry)
  end
  return 0
end
if mode == 'w' then
  redis.call('HDEL', details, token, ':writer')
else
  redis.call('HDEL', details, token)
end
--! include _wake
--! include _queue
--! include _permits_wake
leases_wake(leases, details, channel, KEYS[4], KEYS[5], KEYS[6], KEYS[7], inbox, now,
            mode == 's' and 's' or nil)
leases_drop_if_empty(leases, details)
leases_trim(leases, details, now, expiry)
return 0
