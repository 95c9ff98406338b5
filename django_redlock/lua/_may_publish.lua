-- The ACL asked first, spliced in by `--! include _may_publish` (before a script's first
-- write). A script that writes, then wakes someone (PUBLISH, SPUBLISH), calls may_publish
-- first: Redis does not undo a script's writes when a later command is refused, and a
-- refusal must leave everything as it was (MissingPermission: nothing was done; review k1).
-- `inbox`: the waiters' inbox prefix (nil or '': nobody woken there), `channel`: the release
-- channel announced on (nil or '': none). Redis 7+ (redis.acl_check_cmd, which runs
-- nothing); Redis 6 cannot tell before it runs the command (docs: backends.md, ACLs).
-- The refusal is worded as Redis words one ("no permissions to run the '<command>'
-- command"), so the client names what to add as for any other (acl.refusal).
local function may_publish(inbox, channel)
  local allowed = redis.acl_check_cmd
  if not allowed then
    return
  end
  local refused
  if channel and channel ~= '' and not allowed('PUBLISH', channel, 'released') then
    refused = 'publish'
  elseif inbox and inbox ~= '' then
    if string.byte(inbox, -1) ~= 42 then -- '*': a cluster's sharded inbox (publish, _wake)
      refused = not allowed('PUBLISH', inbox .. 'probe', 'm') and 'publish'
    elseif not allowed('SPUBLISH', inbox .. 'probe', 'm') then
      refused = 'spublish'
    elseif not allowed('PUBLISH', string.match(inbox, '^[^{]*') .. 'inbox:probe', 'm') then
      refused = 'publish' -- a '!' waiter's classic inbox
    end
  end
  if refused then
    error({err = "NOPERM this user has no permissions to run the '" .. refused ..
                 "' command (asked before any write: nothing was done)"})
  end
end

-- A wake-up's PUBLISH or SPUBLISH (`command`). Redis 6 cannot be asked first: a refusal there
-- comes after the write, so it is skipped (redis.pcall) and the write stands: the reply says
-- what was done (a take held, a lock freed), the server's log which command was refused, and
-- the one not woken sleeps to its hint. Counted as heard: nobody is dropped as dead. Redis 7+
-- asked first (may_publish): a refusal here is an error as any other.
local function publish_call(command, channel, message)
  if redis.acl_check_cmd then
    return redis.call(command, channel, message)
  end
  local reply = redis.pcall(command, channel, message)
  if type(reply) == 'table' and reply.err then
    redis.log(redis.LOG_WARNING, 'django-redlock: ' .. command .. ' ' .. channel ..
                                 ' refused after a write, skipped: ' .. reply.err)
    return 1
  end
  return reply
end
