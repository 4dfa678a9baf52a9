-- Leases on worker event streams: one replica writes each worker's events.
-- KEYS[1] <tag>:lease:<node>   KEYS[2] <tag>:seq:<node>
-- KEYS[3] <tag>:replicas (live proxy replicas: zset of heartbeat expiries, ms on this clock)
-- ARGV[1] "take" (take it if free, renew it if ours), "renew" (renew it only if ours: a
-- replica holding its share leaves free leases to the others), "drop" (give it up if ours);
-- ARGV[2] the replica; ARGV[3] ttl in ms.
-- Returns {held (1/0), the node's last applied sequence or -1, live replicas}.
local held = 0
local owner = redis.call('GET', KEYS[1])
local mode = ARGV[1]
if mode == 'take' or mode == 'renew' then
  if owner == ARGV[2] or (not owner and mode == 'take') then
    redis.call('SET', KEYS[1], ARGV[2], 'PX', tonumber(ARGV[3]))
    held = 1
  end
elseif owner == ARGV[2] then
  redis.call('DEL', KEYS[1])
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {held, tonumber(redis.call('GET', KEYS[2]) or '-1'),
        redis.call('ZCOUNT', KEYS[3], now, '+inf')}
