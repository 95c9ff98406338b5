-- Read a queue marker: the task id it names and the milliseconds it has left. Used by the
-- Celery migration shims (celery-singleton's get_existing_task_id, celery-once's countdown).
-- KEYS: marker.  ARGV: none.  Returns {task id, PTTL in ms} or nil when there is none.
local noted = redis.call('GET', KEYS[1])
if not noted then
  return false
end
return {noted, redis.call('PTTL', KEYS[1])}
