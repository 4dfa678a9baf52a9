-- Read one chunk of a match (read only; the walk runs in the client).
-- KEYS[1] hash slot -> node   KEYS[2] <tag>:plive   KEYS[3 .. 2+n] residency keys <tag>:r:<h>
-- KEYS[3+n .. 2+2n] prediction keys <tag>:p:<h> of the same n blocks.   ARGV[1] n.
-- Returns {now_ms, residency values, prediction values ({} while no prediction can exist),
-- {slot, node, ...} for every slot named in those values that names a node}.
-- A value equal to the previous one is not parsed again, so a run of blocks with the same
-- holders costs one parse.
local byte, call = string.byte, redis.call
local n = tonumber(ARGV[1])
local t = call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rkeys = {}
for i = 1, n do rkeys[i] = KEYS[2 + i] end
local rv = call('MGET', unpack(rkeys))
local pv = {}
if call('EXISTS', KEYS[2]) == 1 then
  local pkeys = {}
  for i = 1, n do pkeys[i] = KEYS[2 + n + i] end
  pv = call('MGET', unpack(pkeys))
end
local seen, slots = {}, {}
local function collect(values, size)
  local prev = nil
  for i = 1, #values do
    local v = values[i]
    if v and v ~= prev then
      for j = 1, #v, size do
        local s = byte(v, j) * 256 + byte(v, j + 1)
        if not seen[s] then
          seen[s] = true
          slots[#slots + 1] = s
        end
      end
      prev = v
    end
  end
end
collect(rv, 3)
collect(pv, 16)
local named = {}
if #slots > 0 then
  local names = call('HMGET', KEYS[1], unpack(slots))
  for i = 1, #slots do
    if names[i] then
      named[#named + 1] = slots[i]
      named[#named + 1] = names[i]
    end
  end
end
return {now, rv, pv, named}
