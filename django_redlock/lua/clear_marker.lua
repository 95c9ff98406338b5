-- Delete a marker only if it still names us (compare-and-delete): a newer call may have
-- replaced it meanwhile. Used for Celery's queue-time deduplication.
-- KEYS: marker.  ARGV: expected value.  Returns 1 if deleted.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
