-- Read one chunk of a match (read only; the walk runs in the client).
-- KEYS[1] names epoch   KEYS[2] <tag>:plive   KEYS[3 .. 2+n] residency keys <tag>:r:<h>
-- KEYS[3+n .. 2+2n] prediction keys <tag>:p:<h> of the same n blocks.   ARGV[1] n.
-- Returns {now_ms, names epoch, residency values, prediction values ({} while no prediction
-- can exist)}.
local call = redis.call
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
return {now, tonumber(call('GET', KEYS[1]) or '0'), rv, pv}
