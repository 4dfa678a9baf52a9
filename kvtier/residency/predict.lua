-- Speculative residency of one node, expiring after a TTL (server clock).
-- KEYS[1] hash node -> slot; KEYS[2] set of retired slots; KEYS[3] set of known nodes
-- ARGV[1] key prefix of the model; ARGV[2] node; ARGV[3] bytes per hash; ARGV[4] ttl in ms;
-- ARGV[5] block hashes concatenated.
-- Sets the node's bit in <prefix>q:h and its expiry in hash <prefix>x:h (see match.lua);
-- both keys expire with their longest-lived prediction, as does <prefix>qlive.
-- Fails with NOSLOT like apply.lua.
local bor = bit.bor
local prefix, node, size, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local qp, xp = prefix .. 'q:', prefix .. 'x:'
local slot = tonumber(redis.call('HGET', KEYS[1], node))
if not slot then
  local taken = {}
  for _, s in ipairs(redis.call('HVALS', KEYS[1])) do taken[tonumber(s)] = true end
  for _, s in ipairs(redis.call('SMEMBERS', KEYS[2])) do taken[tonumber(s)] = true end
  for s = 0, 25 do
    if not taken[s] then
      slot = s
      break
    end
  end
  if not slot then
    return redis.error_reply('NOSLOT no free node slot; retired slots need a sweep')
  end
  redis.call('HSET', KEYS[1], node, slot)
end
redis.call('SADD', KEYS[3], node)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = string.format('%d', now + ttl)
local b = bit.lshift(1, slot)
local blob = ARGV[5]
local marker = prefix .. 'qlive' -- tells match that q: keys may exist (see match.lua)
if redis.call('PTTL', marker) < ttl then
  redis.call('SET', marker, '1', 'PX', ttl)
end
for j = 1, #blob, size do
  local h = string.sub(blob, j, j + size - 1)
  local q, x = qp .. h, xp .. h
  local pttl = redis.call('PTTL', q)
  local p = tonumber(redis.call('GET', q)) or 0
  redis.call('SET', q, bor(p, b), 'KEEPTTL')
  redis.call('HSET', x, slot, expiry)
  if pttl < ttl then -- also -2 (new key); never -1: q keys always carry a TTL
    redis.call('PEXPIRE', q, ttl)
    redis.call('PEXPIRE', x, ttl)
  end
end
return slot
