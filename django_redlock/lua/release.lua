-- Release one hold of the caller; free the lock when none are left, and wake its waiters
-- (lock_freed in _hold.lua, lock_wake in _queue.lua).
-- KEYS: lock, release channel (the lock's own key where nobody listens there: a key outside
--       the prefix would be refused to a Redis user limited to it), plain waiters, queue,
--       deadlines[, hand-back marker: given by a hand-back (a plain or fair hold's, see
--       acquire.lua), whose token holding nothing is marked HANDED_BACK_MS].
-- ARGV: token, inbox channel prefix[, the hold's kind: '0' plain, '1' reentrant, or a
--       reentrant owner's ordered write 'seq|levels': its number and the levels the owner
--       holds once this one is released, which the hold is set to, so that a count a lost
--       reply left unsure is settled in the same call (order_stale in _hold.lua), then
--       optionally '|fence', the fence of the hold those levels are in; absent: looked up]
--       [, '1' with the marker: the token was kept from an unanswered try, marked once
--       freed here too].
-- Returns the holds left (0: freed), or -1 when the caller holds none (not ours, or lost; a
-- hold of the owner's under another fence is one a late write made after the owner's was
-- lost: freed when the owner keeps no levels, as the release would have, and still -1);
-- -3 when an ordered write is older than one the hold applied (it ran late: nothing done).
-- A plain hold's release (kind '0') runs first, flat, before any helper is defined (a closure
-- per helper on every call: issue 46); it does what hold_mine and lock_freed in _hold.lua do
-- (keep them in step). The helpers for waking are spliced in after: a release of a lock
-- nobody waits for never defines them. A publish that would follow a write is asked of the
-- ACL first (may_publish in _may_publish.lua; review k1): refused, nothing is written.
local lock, channel, waiting, queue, deadlines = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
if channel == lock then
  channel = ''
end
local token, inbox = ARGV[1], ARGV[2]
local back = KEYS[6]
-- A hand-back that finds nothing to release may have overtaken its own try, still on the wire
-- (acquire.lua refuses a marked token): the marker outlives such a try, whatever the lock's
-- TTL. A request written before its connection was dropped is delivered by TCP's
-- retransmissions, which Linux gives up on an orphaned socket after about 100 s
-- (tcp_orphan_retries: 8 backoffs from 200 ms). A token kept from an unanswered try (its
-- hold's release, or hand-back) is marked once freed too: that try may land after it. Only
-- those write one: nothing more on a common release's path.
local HANDED_BACK_MS = 120000
local kind = ARGV[3] or ''
local woken -- the reply once the lock is freed and someone is to be woken (lock_wake)
if kind == '0' then
  local value = redis.pcall('GET', lock)
  if type(value) ~= 'table' then -- an error (WRONGTYPE, an ACL's refusal): hold_mine's, below
    if not value or string.sub(value, 1, #token + 1) ~= token .. '|' then
      if back then
        redis.call('SET', back, '1', 'PX', HANDED_BACK_MS)
      end
      return -1
    end
    local announce = channel ~= '' and string.byte(inbox, -1) ~= 42 -- announces() in _hold.lua
    local wakes = redis.call('EXISTS', waiting, queue) > 0
    -- A PUBLISH after the DEL is asked of the ACL first (Redis 7+): the announcement here; a
    -- wake-up, or an announcement refused, goes the helpers' way, below (may_publish
    -- refuses before the DEL).
    local ask = redis.acl_check_cmd
    if not (ask and (wakes or (announce and not ask('PUBLISH', channel, 'released')))) then
      redis.call('DEL', lock)
      if back and ARGV[4] then
        redis.call('SET', back, '1', 'PX', HANDED_BACK_MS)
      end
      if announce then -- (Redis 6: a refusal skipped, as publish_call in _may_publish.lua)
        redis.pcall('PUBLISH', channel, 'released')
      end
      if not wakes then
        return 0
      end
      woken = 0
    end
  end
end
--! include _may_publish
--! include _hold
if not woken then
  local count, fence = hold_mine(lock, token, kind == '0' and 'string' or kind ~= '' and 'hash' or nil)
  if count == 0 then
    if back then
      redis.call('SET', back, '1', 'PX', HANDED_BACK_MS)
    end
    return -1
  end
  local seq, levels, mine = order_read(kind)
  local freed = 0
  if seq then
    if order_stale(lock, seq) then
      return -3
    end
    if mine and fence ~= mine then
      if levels > 0 then
        return -1
      end
      freed = -1
    elseif levels > 0 then
      redis.call('HSET', lock, token, levels, ':seq', seq)
      return levels
    end
  elseif count > 1 then
    redis.call('HSET', lock, token, count - 1)
    return count - 1
  end
  local wakes = lock_freed(lock, channel, waiting, queue, inbox)
  if back and ARGV[4] then
    redis.call('SET', back, '1', 'PX', HANDED_BACK_MS)
  end
  if not wakes then
    return freed
  end
  woken = freed
end
--! include _wake
--! include _queue
lock_wake(waiting, queue, deadlines, inbox)
return woken
