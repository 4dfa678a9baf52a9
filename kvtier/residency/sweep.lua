-- Scrub retired slots from a chunk of keys (the client SCANs the model's keys).
-- KEYS: keys of the model; ARGV: the retired slots' numbers.
-- r: keys (3-byte entries: slot, tiers) and p: keys (16-byte entries: slot, expiry) lose the
-- slots' entries; other keys are left alone.
local sub, byte = string.sub, string.byte
local retired = {}
for i = 1, #ARGV do retired[tonumber(ARGV[i])] = true end
for _, key in ipairs(KEYS) do
  local kind = string.match(key, '}:(%a):')
  local size = (kind == 'r' and 3) or (kind == 'p' and 16) or nil
  if size then
    local v = redis.call('GET', key)
    if v then
      local left = {}
      for i = 1, #v, size do
        if not retired[byte(v, i) * 256 + byte(v, i + 1)] then
          left[#left + 1] = sub(v, i, i + size - 1)
        end
      end
      if #left == 0 then
        redis.call('DEL', key)
      elseif #left * size ~= #v then
        redis.call('SET', key, table.concat(left), 'KEEPTTL')
      end
    end
  end
end
return #KEYS
