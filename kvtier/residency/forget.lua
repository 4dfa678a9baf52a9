-- Forget a node: retire its slot (its entries become invisible at once: match resolves only
-- slots that name a node), drop its engine-hash map and sequence, and drop it from the known
-- nodes.
-- KEYS[1] hash node -> slot   KEYS[2] hash slot -> node   KEYS[3] known nodes
-- KEYS[4] set of retired slots   KEYS[5] the node's engine-hash map   KEYS[6] its sequence
-- KEYS[7] names epoch (bumped when a slot is retired: readers drop their cached names)
-- ARGV[1] node.   Returns the number of retired slots awaiting a sweep.
local slot = redis.call('HGET', KEYS[1], ARGV[1])
if slot then
  redis.call('SADD', KEYS[4], slot)
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], slot)
  redis.call('INCR', KEYS[7])
end
redis.call('DEL', KEYS[5], KEYS[6])
redis.call('SREM', KEYS[3], ARGV[1])
return redis.call('SCARD', KEYS[4])
