-- Release a plain lock only if it still holds our token (compare-and-delete), then wake
-- the waiters on the lock's channel.
-- KEYS: lock, release channel.  ARGV: token.  Returns 1 if released, 0 if not ours.
local held = redis.pcall('GET', KEYS[1])
local mine = ARGV[1] .. '|'
if type(held) == 'string' and string.sub(held, 1, #mine) == mine then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', KEYS[2], 'released')
  return 1
end
return 0
