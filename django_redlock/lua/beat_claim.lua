-- Beat: claim an entry's run for the leader, atomic with the send decision.
-- KEYS: the leader lock, the entry's record.
-- ARGV: token, the last run the decision is based on ('' if none), the new run, the
--       record's TTL in ms.
-- Returns {0} not the leader, {1, record} another run is recorded, {2} claimed (again, when
-- this token already recorded this run: a re-send after a failed publish).
if redis.call('TYPE', KEYS[1]).ok ~= 'string' then return {0} end
local held = redis.call('GET', KEYS[1])
if string.sub(held, 1, #ARGV[1] + 1) ~= ARGV[1] .. '|' then return {0} end
local record = redis.call('GET', KEYS[2])
if record then
  local at, by = string.match(record, '^([^|]*)|(.*)$')
  if at == ARGV[3] and by == ARGV[1] then return {2} end
  if at ~= ARGV[2] then return {1, record} end
end
redis.call('SET', KEYS[2], ARGV[3] .. '|' .. ARGV[1], 'PX', ARGV[4])
return {2}
