-- Scrub retired slots from one step of a scan over the residency or prediction hash.
-- KEYS[1] <tag>:res or <tag>:pred   ARGV[1] "r" or "p"   ARGV[2] scan cursor   ARGV[3] count
-- ARGV[4..] the retired slots' numbers.   Returns the next cursor ("0": done).
-- r: values (bitmaps: bits 2*slot, 2*slot+1, little-endian) lose the slots' bits; p: values
-- (16-byte entries: slot, expiry) lose the slots' entries. Emptied fields are deleted.
local call, sub, byte, char = redis.call, string.sub, string.byte, string.char
local band = bit.band
local retired, slots = {}, {}
for i = 4, #ARGV do
  local s = tonumber(ARGV[i])
  retired[s] = true
  slots[#slots + 1] = s
end
local scan = call('HSCAN', KEYS[1], ARGV[2], 'COUNT', tonumber(ARGV[3]))
local found = scan[2]
for i = 1, #found, 2 do
  local f, v = found[i], found[i + 1]
  local new = v
  if ARGV[1] == 'r' then
    for _, s in ipairs(slots) do
      local at = math.floor(s / 4) + 1
      local b = byte(new, at)
      local m = 3 * 2 ^ ((2 * s) % 8)
      if b and band(b, m) ~= 0 then
        new = sub(new, 1, at - 1) .. char(b - band(b, m)) .. sub(new, at + 1)
      end
    end
    new = string.gsub(new, '%z+$', '')
  else
    local left = {}
    for k = 1, #v, 16 do
      if not retired[byte(v, k) * 256 + byte(v, k + 1)] then left[#left + 1] = sub(v, k, k + 15) end
    end
    new = table.concat(left)
  end
  if new == '' then
    call('HDEL', KEYS[1], f)
  elseif new ~= v then
    call('HSET', KEYS[1], f, new)
  end
end
return scan[1]
