-- Reset the TTL of a hold only if the caller holds it (compare-and-PEXPIRE), so a renewal
-- can never extend someone else's hold: a lock's, or a semaphore's or read-write lock's lease.
-- KEYS: lock, and (optional: Cluster declares it) its details hash.  ARGV: token, ttl ms.
-- Returns 1 if extended, 0 if not ours.
-- The TTL is set to ttl exactly, shorter or longer (renew.lua's never shortens).
--! include _hold
--! include _permits
return any_extend(KEYS[1], ARGV[1], ARGV[2], false, KEYS[2])
