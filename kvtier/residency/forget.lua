-- Forget a node: retire its slot (its bits become invisible at once) and drop it from the
-- known nodes. KEYS[1] hash node -> slot; KEYS[2] set of retired slots; KEYS[3] known nodes
-- ARGV[1] node. Returns the number of retired slots awaiting a sweep.
local slot = redis.call('HGET', KEYS[1], ARGV[1])
if slot then
  redis.call('SADD', KEYS[2], slot)
  redis.call('HDEL', KEYS[1], ARGV[1])
end
redis.call('SREM', KEYS[3], ARGV[1])
return redis.call('SCARD', KEYS[2])
