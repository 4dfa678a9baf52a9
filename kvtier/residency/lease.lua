-- Leases on worker event streams: one replica writes each worker's events.
-- KEYS[1] <tag>:lease:<node>   KEYS[2] <tag>:seq:<node>
-- ARGV[1] "take" (take it if free, renew it if ours), "drop" (give it up if ours);
-- ARGV[2] the replica; ARGV[3] ttl in ms.
-- Returns {held (1/0), the node's last applied sequence or -1}.
local held = 0
local owner = redis.call('GET', KEYS[1])
if ARGV[1] == 'take' then
  if owner == ARGV[2] or not owner then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', tonumber(ARGV[3]))
    held = 1
  end
elseif owner == ARGV[2] then
  redis.call('DEL', KEYS[1])
end
return {held, tonumber(redis.call('GET', KEYS[2]) or '-1')}
