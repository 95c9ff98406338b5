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
