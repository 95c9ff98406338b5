-- Which commands the caller's Redis user may not run, checked against its ACL without running
-- any (redis.acl_check_cmd, Redis 7+): what the app needs, told at startup.
-- KEYS: a key of ours (routes the call on a cluster, and the user must be let pass it).
-- ARGV: the commands, each as its number of arguments, then its arguments (keys and
--       channels under the prefix).
-- Returns the numbers (from 1) of the commands refused; {-1} where Redis cannot tell (6.x).
-- A command this server does not know is not counted as refused.
if not redis.acl_check_cmd then
  return {-1}
end
local refused, i, n = {}, 1, 0
while i <= #ARGV do
  local count = tonumber(ARGV[i])
  n = n + 1
  local known, allowed = pcall(redis.acl_check_cmd, unpack(ARGV, i + 1, i + count))
  if known and not allowed then
    refused[#refused + 1] = n
  end
  i = i + count + 1
end
return refused
