-- Clear retired slots' bits from a chunk of keys (the client SCANs the model's keys).
-- KEYS: keys of the model; ARGV[1] bitmask of the retired slots; ARGV[2..] their numbers.
-- r: keys (residency G + C * 2^26) and q: keys (prediction masks) lose the bits; x: keys
-- (prediction expiries) lose the slots' fields; other keys are left alone.
local band, bnot = bit.band, bit.bnot
local SPLIT = 67108864 -- 2^26
local keep = bnot(tonumber(ARGV[1]))
for _, key in ipairs(KEYS) do
  local kind = string.match(key, '}:(%a):')
  if kind == 'r' then
    local v = tonumber(redis.call('GET', key))
    if v then
      local g = v % SPLIT
      local c = (v - g) / SPLIT
      local new = band(g, keep) + band(c, keep) * SPLIT
      if new == 0 then redis.call('DEL', key) elseif new ~= v then redis.call('SET', key, string.format('%.0f', new)) end
    end
  elseif kind == 'q' then
    local v = tonumber(redis.call('GET', key))
    if v then
      local new = band(v, keep)
      if new == 0 then redis.call('DEL', key)
      elseif new ~= v then redis.call('SET', key, new, 'KEEPTTL') end
    end
  elseif kind == 'x' then
    for i = 2, #ARGV do redis.call('HDEL', key, ARGV[i]) end
  end
end
return #KEYS
