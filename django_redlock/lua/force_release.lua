-- Delete a lock whoever holds it (operators only) and wake its waiters. The holder finds
-- the hold gone at its next renewal, extend or release.
-- KEYS: lock, release channel.  Returns 1 if a lock was deleted.
if redis.call('DEL', KEYS[1]) == 1 then
  redis.call('PUBLISH', KEYS[2], 'released')
  return 1
end
return 0
