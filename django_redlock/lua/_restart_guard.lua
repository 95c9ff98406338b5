-- The restart guard (Redlock), spliced into acquire.lua and redlock_acquire.lua where they
-- have `marker` (the node marker's key, nil without one), `guard` (ms) and `now` (ms).
-- A node whose marker is gone has lost its data (restarted empty, flushed, failed over to an
-- empty replica) and may have forgotten locks it granted. It votes no until locks granted
-- before the loss have surely expired: the script returns {0, ms left of the guard}.
-- The marker is '<ms>' or '<ms> trusted': <ms> is always when this node's data began (the
-- fence floor, redlock_acquire.lua), never lowered; ' trusted' is a new deployment's startup
-- mark (mark_node.lua), the guard waived. One key for both: lost together with the data.
-- When this node's data began (ms), and whether trusted; written now when the marker is gone.
local function data_since(trust)
  local value = redis.call('GET', marker) or ''
  local since = tonumber(string.match(value, '^%d+'))
  if not since then
    redis.call('SET', marker, string.format(trust and '%d trusted' or '%d', now))
    return now, trust
  end
  return since, string.sub(value, -8) == ' trusted'
end
if marker and guard > 0 then
  local since, trusted = data_since(false)
  if not trusted and now - since < guard then
    return {0, guard - (now - since)}
  end
end
