-- Beat: a claimed run whose message could not be published goes back to the run before it
-- (only if the record is still this claim), so the run stays due and is sent when the broker
-- is back.
-- KEYS: the entry's record.
-- ARGV: token, the run before ('' if none), the claimed run, the record's TTL in ms.
-- Returns 1 handed back (or 1 from DEL: the record removed), 0 the record is not this claim.
if redis.call('GET', KEYS[1]) ~= ARGV[3] .. '|' .. ARGV[1] then return 0 end
if ARGV[2] == '' then return redis.call('DEL', KEYS[1]) end
redis.call('SET', KEYS[1], ARGV[2] .. '|' .. ARGV[1], 'PX', ARGV[4])
return 1
