-- Speculative residency of one node, expiring after a TTL (server clock).
-- KEYS[1] hash node -> slot; KEYS[2] set of retired slots; KEYS[3] set of known nodes
-- ARGV[1] key prefix of the model; ARGV[2] node; ARGV[3] bytes per hash; ARGV[4] ttl in ms;
-- ARGV[5] block hashes concatenated.
-- Writes the node's entry (slot, expiry) into <prefix>p:h (see match.lua), replacing its
-- older one and dropping expired entries; the key expires with its longest-lived prediction,
-- as does <prefix>plive. Fails with NOSLOT like apply.lua.
local sub, tonumber, call = string.sub, tonumber, redis.call
local ENTRY = 16
local prefix, node, size, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local pp = prefix .. 'p:'
local slot = tonumber(call('HGET', KEYS[1], node))
if not slot then
  local taken = {}
  for _, s in ipairs(call('HVALS', KEYS[1])) do taken[tonumber(s)] = true end
  for _, s in ipairs(call('SMEMBERS', KEYS[2])) do taken[tonumber(s)] = true end
  for s = 0, 25 do
    if not taken[s] then
      slot = s
      break
    end
  end
  if not slot then
    return redis.error_reply('NOSLOT no free node slot; retired slots need a sweep')
  end
  call('HSET', KEYS[1], node, slot)
end
call('SADD', KEYS[3], node)
local t = call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local entry = string.format('%02d%014d', slot, now + ttl)
local blob = ARGV[5]
local marker = prefix .. 'plive' -- tells match that p: keys may exist (see match.lua)
if call('PTTL', marker) < ttl then
  call('SET', marker, '1', 'PX', ttl)
end
for j = 1, #blob, size do
  local key = pp .. sub(blob, j, j + size - 1)
  local pttl = call('PTTL', key) -- -2 when new; never -1: p: keys always carry a TTL
  local old = call('GET', key)
  local keep = {}
  if old then
    for i = 1, #old, ENTRY do
      local s, x = tonumber(sub(old, i, i + 1)), tonumber(sub(old, i + 2, i + ENTRY - 1))
      if s ~= slot and x > now then keep[#keep + 1] = sub(old, i, i + ENTRY - 1) end
    end
  end
  keep[#keep + 1] = entry
  if pttl < ttl then
    call('SET', key, table.concat(keep), 'PX', ttl)
  else
    call('SET', key, table.concat(keep), 'KEEPTTL')
  end
end
return slot
