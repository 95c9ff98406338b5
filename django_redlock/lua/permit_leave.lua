-- A waiter for a lease leaves (timed out, cancelled): out of the plain waiters, the fair
-- queue or the waiting writers. Whoever can go now is woken: the one leaving may have been
-- woken already, and a writer that stops waiting lets the readers in.
-- KEYS: leases, details, release channel (the leases' own key where nobody listens there),
--       plain waiters, queue, deadlines, waiting writers.
-- ARGV: waiter id, inbox channel prefix.
--! include _may_publish
--! include _hold
--! include _wake
--! include _queue
--! include _permits
--! include _permits_wake
local waiter = ARGV[1]
local channel = KEYS[3] ~= KEYS[1] and KEYS[3] or ''
may_publish(ARGV[2], announces(channel, ARGV[2]) and channel) -- leases_wake's, after the writes
redis.call('ZREM', KEYS[4], waiter)
redis.call('LREM', KEYS[5], 0, waiter)
redis.call('ZREM', KEYS[6], waiter)
redis.call('ZREM', KEYS[7], waiter)
leases_wake(KEYS[1], KEYS[2], channel, KEYS[4], KEYS[5], KEYS[6], KEYS[7], ARGV[2], now_ms())
return 1
