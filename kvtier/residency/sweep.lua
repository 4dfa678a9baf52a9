-- Clear retired slots' bits from a chunk of keys (the client SCANs the model's keys).
-- KEYS: keys of the model; ARGV[1] bitmask of the retired slots; ARGV[2..] their numbers.
-- r: keys (residency G + C * 2^26) lose the bits; p: keys (prediction entries, see
-- match.lua) lose the slots' entries; other keys are left alone.
local band, bnot = bit.band, bit.bnot
local SPLIT = 67108864 -- 2^26
local ENTRY = 16
local keep = bnot(tonumber(ARGV[1]))
local retired = {}
for i = 2, #ARGV do retired[tonumber(ARGV[i])] = true end
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
  elseif kind == 'p' then
    local v = redis.call('GET', key)
    if v then
      local left = {}
      for i = 1, #v, ENTRY do
        if not retired[tonumber(string.sub(v, i, i + 1))] then
          left[#left + 1] = string.sub(v, i, i + ENTRY - 1)
        end
      end
      if #left == 0 then redis.call('DEL', key)
      elseif #left * ENTRY ~= #v then redis.call('SET', key, table.concat(left), 'KEEPTTL') end
    end
  end
end
return #KEYS
