-- Apply translated residency operations of one node.
-- KEYS[1] hash node -> slot; KEYS[2] set of retired slots; KEYS[3] set of known nodes
-- ARGV[1] key prefix of the model; ARGV[2] node; ARGV[3] bytes per hash; then operations:
--   "S", tier ("G"/"C"), hashes concatenated   -- became resident
--   "R", tier, hashes concatenated             -- left the tier
--   "C"                                        -- cleared: the node's slot is retired
-- Residency of block h is the string <prefix>r:h = G + C * 2^26 (see match.lua). A node
-- gets a free slot when it first stores; a retired slot's bits are ignored by match until a
-- sweep clears them. Fails with NOSLOT, before writing anything, when the batch needs more
-- free slots than there are (26 per model, live and retired together).
local band = bit.band
local SPLIT = 67108864 -- 2^26
local prefix, node, size = ARGV[1], ARGV[2], tonumber(ARGV[3])
local rp = prefix .. 'r:'
local slot = tonumber(redis.call('HGET', KEYS[1], node))
-- Dry run: how many new slots does this batch take?
local has, need, i = slot ~= nil, 0, 4
while i <= #ARGV do
  if ARGV[i] == 'C' then
    has = false
    i = i + 1
  else
    if ARGV[i] == 'S' and not has then
      need = need + 1
      has = true
    end
    i = i + 3
  end
end
local taken = {}
for _, s in ipairs(redis.call('HVALS', KEYS[1])) do taken[tonumber(s)] = true end
for _, s in ipairs(redis.call('SMEMBERS', KEYS[2])) do taken[tonumber(s)] = true end
local free = {}
for s = 25, 0, -1 do
  if not taken[s] then free[#free + 1] = s end
end
if need > #free then
  return redis.error_reply('NOSLOT no free node slot; retired slots need a sweep')
end
redis.call('SADD', KEYS[3], node)
i = 4
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'C' then
    if slot then
      redis.call('SADD', KEYS[2], slot)
      redis.call('HDEL', KEYS[1], node)
      slot = nil
    end
    i = i + 1
  else
    local blob = ARGV[i + 2]
    if op == 'S' and not slot then
      slot = table.remove(free)
      redis.call('HSET', KEYS[1], node, slot)
    end
    if slot then
      local b = bit.lshift(1, slot)
      local gpu = ARGV[i + 1] == 'G'
      local delta = b
      if not gpu then delta = b * SPLIT end
      for j = 1, #blob, size do
        local key = rp .. string.sub(blob, j, j + size - 1)
        local v = tonumber(redis.call('GET', key)) or 0
        local g = v % SPLIT
        local mask = g
        if not gpu then mask = (v - g) / SPLIT end
        local held = band(mask, b) ~= 0
        if op == 'S' and not held then
          redis.call('SET', key, string.format('%.0f', v + delta))
        elseif op == 'R' and held then
          if v == delta then
            redis.call('DEL', key)
          else
            redis.call('SET', key, string.format('%.0f', v - delta))
          end
        end
      end
    end
    i = i + 3
  end
end
return slot
