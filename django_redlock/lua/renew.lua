-- The watchdog's batch: extend many holds in one call, each only if still ours
-- (compare-and-PEXPIRE, as extend.lua does for one): locks and leases (semaphore permits,
-- read and write holds) alike, told apart by their key's type. A renewal never shortens a
-- hold: it keeps at least its ttl, more if it has more (any_extend's `at_least`: another
-- holder of the token, an adopter, may have set a longer one).
-- KEYS: the locks, then (optional: Cluster declares them) their details hashes, in order.
-- ARGV[1]: their tokens joined by '|' (a token never holds one).
-- ARGV[2]: one ttl ms for all, or one per lock joined by '|'.
-- Two arguments, not two per lock: packing hundreds of arguments is the client's main cost.
-- Returns one 1 (extended) or 0 (not ours any more) per lock.
--! include _hold
--! include _permits
local ttls = {}
for ttl in string.gmatch(ARGV[2], '[^|]+') do
  ttls[#ttls + 1] = ttl
end
local tokens = {}
for token in string.gmatch(ARGV[1], '[^|]+') do
  tokens[#tokens + 1] = token
end
local n = #tokens
local results = {}
for i, token in ipairs(tokens) do
  results[i] = any_extend(KEYS[i], token, ttls[i] or ttls[1], true, KEYS[n + i])
end
return results
