-- The restart guard (Redlock), spliced into acquire.lua and redlock_acquire.lua where they
-- have `marker` (the node marker's key, nil without one), `guard` (ms) and `now` (ms).
-- A node whose marker is gone has lost its data (restarted empty, flushed, failed over to an
-- empty replica) and may have forgotten locks it granted. It votes no until locks granted
-- before the loss have surely expired: the script returns {0, ms left of the guard}.
-- When this node's data began (ms, the marker): now, when the marker is gone.
local function data_since()
  local since = tonumber(redis.call('GET', marker))
  if not since then
    redis.call('SET', marker, string.format('%d', now))
    since = now
  end
  return since
end
if marker and guard > 0 then
  local since = data_since()
  if now - since < guard then
    return {0, guard - (now - since)}
  end
end
