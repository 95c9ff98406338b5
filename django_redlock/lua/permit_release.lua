-- Release one hold of a lease (a permit, a read or a write); free the lease when none are
-- left, and wake as many waiters as can now take one (see leases_wake).
-- KEYS: leases, details, release channel, plain waiters, queue, deadlines, waiting writers.
-- ARGV: token, inbox channel prefix.
-- Returns the holds left (0: freed), or -1 when the caller holds none (not ours, or lost).
--! include _hold
--! include _wake
--! include _queue
--! include _permits
local leases, details, channel = KEYS[1], KEYS[2], KEYS[3]
local token, inbox = ARGV[1], ARGV[2]
local now = now_ms()
local count, _, mode = lease_mine(leases, details, token, now)
if count == 0 then
  return -1
end
if count > 1 then
  return lease_recount(details, token, -1)
end
redis.call('ZREM', leases, token)
redis.call('HDEL', details, token)
if mode == 'w' then
  redis.call('HDEL', details, ':writer')
end
leases_wake(leases, details, channel, KEYS[4], KEYS[5], KEYS[6], KEYS[7], inbox, now,
            mode == 's' and 's' or nil)
leases_drop_if_empty(leases, details)
return 0
