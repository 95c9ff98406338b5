-- Note a queued Celery task under its lock's key, unless a task is noted there already:
-- queue-time deduplication. The marker sits beside the lock, in its hash slot.
-- KEYS: marker.  ARGV: task id, TTL in ms.  Returns the task id noted before, nil if ours is.
local queued = redis.call('GET', KEYS[1])
if queued then
  return queued
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
