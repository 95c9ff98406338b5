-- A reader's settle (a read-write lock's read, whose token is its owner's): refuse the owner's
-- reads sent before this call, then say how many read levels the owner holds. A read still on
-- the wire (an interrupted try, or one whose reply was lost: this settle, on another
-- connection, may overtake it) takes nothing when it lands (permit_acquire.lua), so the count
-- returned is final: the client brings it to what its process believes (permit_release.lua).
-- The owner's later reads carry larger numbers and are taken as usual.
-- KEYS: leases, details, the owner's hand-back marker.
-- ARGV: owner, this settle's write number (identity.write_seq: above every read the owner
--       sent before).
-- Returns the owner's live read count (0: none).
--! include _hold
--! include _permits
local back, seq = KEYS[3], tonumber(ARGV[2])
local last = tonumber(redis.call('GET', back))
if not last or last < seq then
  -- As long as release.lua's HANDED_BACK_MS (keep them in step).
  redis.call('SET', back, ARGV[2], 'PX', 120000)
end
return (lease_mine(KEYS[1], KEYS[2], ARGV[1], now_ms()))
