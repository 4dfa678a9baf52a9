-- Scrub retired slots from a chunk of keys (the client SCANs the model's keys).
-- KEYS: keys of the model; ARGV: the retired slots' numbers.
-- r: keys (bitmaps: bits 2*slot, 2*slot+1) lose the slots' bits; p: keys (16-byte entries:
-- slot, expiry) lose the slots' entries; other keys are left alone.
local sub, byte = string.sub, string.byte
local retired = {}
for i = 1, #ARGV do retired[tonumber(ARGV[i])] = true end
for _, key in ipairs(KEYS) do
  local kind = string.match(key, '}:(%a):')
  if kind == 'r' then
    for s in pairs(retired) do
      redis.call('SETBIT', key, 2 * s, 0)
      redis.call('SETBIT', key, 2 * s + 1, 0)
    end
    if redis.call('BITCOUNT', key) == 0 then redis.call('DEL', key) end
  elseif kind == 'p' then
    local v = redis.call('GET', key)
    if v then
      local left = {}
      for i = 1, #v, 16 do
        if not retired[byte(v, i) * 256 + byte(v, i + 1)] then
          left[#left + 1] = sub(v, i, i + 15)
        end
      end
      if #left == 0 then
        redis.call('DEL', key)
      elseif #left * 16 ~= #v then
        redis.call('SET', key, table.concat(left), 'KEEPTTL')
      end
    end
  end
end
return #KEYS
