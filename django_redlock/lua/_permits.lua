-- Helpers for semaphores and read-write locks, spliced in by `--! include _permits` (after
-- _hold; leases_wake is in _permits_wake, after _wake and _queue). Every hold of such a name is a lease: the name's own key is a
-- sorted set of token -> expiry (server ms), and a hash beside it (key .. ':h') has each
-- lease's 'fence|acquired-ms|count|mode|holder' (mode: s permit, r read, w write), plus
-- ':limit' (a semaphore's limit at the last grant), ':writer' (a read-write lock's writer)
-- and ':kind' ('s' semaphore, 'rw' read-write lock: the last grant's; one name is one kind
-- at a time, so while any lease lives it is the kind of every live lease). A lease is live
-- while its expiry is in the future on the server's clock, so a crashed holder's lease frees
-- at its TTL whatever the clients' clocks say. The set and the hash live exactly as long as
-- the longest lease (leases_grow, leases_trim).
local LEASES_PRUNE_MAX = 100 -- per call: a crowd of expired leases never blocks Redis long

local function ms_text(ms)
  return string.format('%d', ms)
end

-- Drop expired leases (bounded); the number of live leases.
local function leases_prune(leases, details, now)
  local gone = redis.call('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, LEASES_PRUNE_MAX)
  if #gone > 0 then
    redis.call('ZREM', leases, unpack(gone))
    redis.call('HDEL', details, unpack(gone))
  end
  if #gone < LEASES_PRUNE_MAX then -- every expired one is gone: all the rest are live
    return redis.call('ZCARD', leases)
  end
  return redis.call('ZCOUNT', leases, '(' .. ms_text(now), '+inf')
end

-- Both keys live at least `ttl` ms more (they never outlive their last lease by more than
-- the TTL it was last given; the details hash always expires with the leases).
local function leases_grow(leases, details, ttl)
  if redis.call('PTTL', leases) < tonumber(ttl) then
    redis.call('PEXPIRE', leases, ttl)
    redis.call('PEXPIRE', details, ttl)
  end
end

-- After a lease was removed or shortened (it may have been the longest): both keys live
-- exactly as long as the longest lease left, so the name's key exists only while a lease
-- lives (a lock's EXISTS and PTTL of the name never see a stale set: one name, one kind).
-- `gone`: the expiry the lease had, if one: a key that outlives it had a longer lease, which
-- is still there (one PTTL, the common case of a release among holders).
local function leases_trim(leases, details, now, gone)
  local pttl = redis.call('PTTL', leases)
  if gone and pttl > tonumber(gone) - now + 1 then
    return
  end
  local last = redis.call('ZRANGE', leases, -1, -1, 'WITHSCORES')[2]
  if last then
    local keep = math.max(1, tonumber(last) - now)
    if pttl > keep then
      redis.call('PEXPIRE', leases, keep)
      redis.call('PEXPIRE', details, keep)
    end
  end
end

-- Gone with the last lease: no keys left but the fence counter.
local function leases_drop_if_empty(leases, details)
  if redis.call('ZCARD', leases) == 0 then
    redis.call('DEL', details)
  end
end

-- `token`'s live lease: its count (0: none), fence and mode. `expiry`: its ZSCORE, when the
-- caller has it already. `mode`: the mode the caller took it in, when only its count and
-- mode are wanted and it is a permit or a write ('s', 'w': one hold each, no fence read).
local function lease_mine(leases, details, token, now, expiry, mode)
  if expiry == nil then
    expiry = redis.pcall('ZSCORE', leases, token)
    if wrongtype(expiry) then -- the name is a lock's now (a plain, reentrant or fair one)
      return 0, nil, nil
    end
  end
  expiry = tonumber(expiry)
  if not expiry or expiry <= now then
    return 0, nil, nil
  end
  if mode == 's' or mode == 'w' then
    return 1, nil, mode
  end
  local detail = redis.call('HGET', details, token) or ''
  local fence, count, mode = string.match(detail, '^(%d*)|%d*|(%d*)|(%a*)')
  return tonumber(count) or 1, tonumber(fence), mode
end

-- A lease's detail with another count (reentrant reads).
local function lease_recount(details, token, delta)
  local detail = redis.call('HGET', details, token)
  local head, count, tail = string.match(detail, '^([^|]*|[^|]*|)(%d+)(.*)$')
  count = tonumber(count) + delta
  redis.call('HSET', details, token, head .. ms_text(count) .. tail)
  return count
end

-- Take a lease with the next fence of the name (the lock's fence helper and counter);
-- `...`: more fields of the details hash to set at once (':limit', ':writer'). `fresh`: the
-- name had no live lease (keys just made: their TTL is set without looking it up first).
-- Returns the fence and, for a writer, the token of the last exclusive hold given one before.
local function lease_take(leases, details, counter, token, ttl, meta, mode, now, fresh, ...)
  local fence, text, prior = fence_next(counter)
  redis.call('ZADD', leases, ms_text(now + ttl), token)
  redis.call('HSET', details, token, text .. '|' .. ms_text(now) .. '|1|' .. mode .. '|' .. meta,
             ...)
  fence_keep(counter, text, ttl, mode == 'w' and token or prior) -- only a writer records
  if fresh then
    redis.call('PEXPIRE', leases, ttl)
    redis.call('PEXPIRE', details, ttl)
  else
    leases_grow(leases, details, ttl)
  end
  return fence, mode == 'w' and prior or ''
end

-- Extend `token`'s live lease to ttl ms from now; 1 if extended, 0 if it holds none.
-- `at_least`: never shorten it (a renewal: see any_extend).
local function lease_extend(leases, details, token, ttl, now, at_least)
  local expiry = tonumber(redis.call('ZSCORE', leases, token))
  if not expiry or expiry <= now then
    return 0
  end
  if not at_least or expiry < now + ttl then
    redis.call('ZADD', leases, 'XX', ms_text(now + ttl), token)
    if expiry > now + ttl then
      leases_trim(leases, details, now, expiry) -- shortened: it may have been the longest
    else
      leases_grow(leases, details, ttl)
    end
  end
  return 1
end

-- Any hold of `key` by `token`, a lock's (string, hash) or a lease (sorted set): what the
-- watchdog's batch and extend run, so locks and leases share batches. 1 if extended, 0 if
-- not ours. `at_least` (the watchdog's renewals): the hold keeps at least `ttl` ms, and
-- keeps more if it has more. Several holders may renew one token with their own TTLs (a
-- hand-over: the old holder still renews after adopt() set the adopter's longer TTL), and
-- none may cut another's time short. An extend() sets `ttl` exactly. `details`: the lease's
-- hash as the caller declared it (Cluster: a slot moved key by key then answers ASK or
-- TRYAGAIN instead of running half of this, and the writer's mark never runs out apart).
local function any_extend(key, token, ttl, at_least, details)
  local kind = redis.call('TYPE', key).ok
  if kind == 'zset' then
    return lease_extend(key, details or (key .. ':h'), token, ttl, now_ms(), at_least)
  end
  if hold_mine(key, token, kind) > 0 then
    if at_least and redis.call('PTTL', key) >= tonumber(ttl) then
      return 1
    end
    return redis.call('PEXPIRE', key, ttl)
  end
  return 0
end

-- Whether a live writer holds a read-write lock.
local function writer_holds(leases, details, now)
  local writer = redis.call('HGET', details, ':writer')
  local expiry = writer and tonumber(redis.call('ZSCORE', leases, writer))
  return expiry ~= nil and expiry ~= false and expiry > now
end

-- Waiting writers (token -> lease deadline) still alive.
local function writers_waiting(writers, now)
  if redis.call('EXISTS', writers) == 0 then
    return 0
  end
  redis.call('ZREMRANGEBYSCORE', writers, '-inf', now)
  return redis.call('ZCARD', writers)
end
