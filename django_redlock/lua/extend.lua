-- Reset the TTL of a lock only if the caller holds it (compare-and-PEXPIRE), so a renewal
-- can never extend someone else's hold.
-- KEYS: lock.  ARGV: token, ttl ms.  Returns 1 if extended, 0 if not ours.
--! include _hold
if hold_mine(KEYS[1], ARGV[1]) > 0 then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
