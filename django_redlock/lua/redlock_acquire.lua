-- Redlock: take a plain lock on one node, with a fence the nodes of a majority agree on.
-- KEYS: lock, fence counter, node marker (when this node's data began, ms; the restart
--       guard's too).
-- ARGV: token, ttl ms, holder metadata, proposed fence, restart guard ms (0: off).
-- Returns {1, fence, 1, token of the hold given a fence before on this node ('': unknown, or
-- held already)} when held by the caller (taken now, or already: a lost reply), else
-- {0, ms until it may be free (-1: unknown), a digest of the holder's token ('': unknown)}:
-- the acquirer counts the nodes one holder has (a majority: held, not a split vote).
-- The fence is max(counter + 1, this server's clock in us, the proposal (at most that clock
-- + 2 s)): the acquirer proposes its clock + 1 s, above every node's clock and below every
-- node's cap while the clocks agree within 1 s either way, so nodes whose counters agree
-- return the same fence and no node lags (docs/topics/backends.md, "Fencing across the
-- quorum").
--! include _hold
local lock, counter, marker = KEYS[1], KEYS[2], KEYS[3]
local token, ttl, meta, proposal = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local guard = tonumber(ARGV[5]) or 0 -- 0: off
local now = now_ms()

--! include _restart_guard

-- A proposal counts only up to this node's clock + 2 s (twice FENCE_LEAD_US: a node up to
-- 1 s behind the acquirer still grants its proposal): an acquirer whose clock runs far ahead
-- must not lift fences above what this node's clock reaches long before the counter is
-- forgotten (FENCE_MEMORY_MS), or a later fence, from the clock, would be smaller.
local CAP_US = 2000000
proposal = math.min(proposal, now_us + CAP_US)
local last, prior = fence_read(counter)
local fence = math.max(last + 1, now_us, proposal)
-- No counter: the name is new or idle (the clock is past its old fences), or this node lost
-- its data, and with it fences up to its clock + the cap, granted before the marker (gone
-- with them) was written again. At least that time + the cap, then: above them even for an
-- acquirer behind the one that got them. Past the first 2 s of the node's data this is
-- below the clock, so a healthy node's fences and round trips do not change.
if last == 0 then
  local since = data_since(false)
  fence = math.max(fence, (since + 1) * 1000 + CAP_US)
end
local text = string.format('%d', fence)
local value = token .. '|' .. text .. '|' .. string.format('%d', now) .. '|' .. meta
if redis.call('SET', lock, value, 'NX', 'PX', ttl) then
  fence_keep(counter, text, ttl, token)
  return {1, fence, 1, prior}
end
-- Ours already: the reply to an earlier try was lost.
local count, held = hold_mine(lock, token, 'string')
if count > 0 then
  redis.call('PEXPIRE', lock, ttl)
  return {1, held, 1}
end
local value = redis.pcall('GET', lock)  -- a reentrant hold (a hash) by the same name: ''
local holder = type(value) == 'string' and redis.sha1hex(string.match(value, '^[^|]*')) or ''
return {0, redis.call('PTTL', lock), holder}
