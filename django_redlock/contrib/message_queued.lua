-- Whether a Celery message is still in a Redis broker (kombu's redis transport): in one of its
-- queue's lists (one per priority step) or in the hash of messages delivered to a worker and
-- not yet acknowledged (prefetched, waiting for their ETA, or running with acks_late).
-- Runs on the broker, not on a lock backend. Reads only; O(messages), so bounded by ARGV[2].
-- KEYS: the queue's lists..., then the unacked hash (last).
-- ARGV: the task id as JSON text ("<id>", quotes included), the most messages to read.
-- Returns 1: found; 0: in none of them; -1: more messages than ARGV[2] (not read: unknown).
local needle = ARGV[1]
local most = tonumber(ARGV[2])
local unacked = KEYS[#KEYS]
local total = redis.call('HLEN', unacked)
for i = 1, #KEYS - 1 do
  total = total + redis.call('LLEN', KEYS[i])
end
if total > most then
  return -1
end
for i = 1, #KEYS - 1 do
  for _, message in ipairs(redis.call('LRANGE', KEYS[i], 0, -1)) do
    if string.find(message, needle, 1, true) then
      return 1
    end
  end
end
for _, message in ipairs(redis.call('HVALS', unacked)) do
  if string.find(message, needle, 1, true) then
    return 1
  end
end
return 0
