-- Reset the TTL of a plain lock only if it still holds our token.
-- KEYS: lock.  ARGV: token, ttl ms.  Returns 1 if extended, 0 if not ours.
local held = redis.pcall('GET', KEYS[1])
local mine = ARGV[1] .. '|'
if type(held) == 'string' and string.sub(held, 1, #mine) == mine then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
