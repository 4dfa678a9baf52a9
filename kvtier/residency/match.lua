-- Residency match: one round trip, walking the prompt's block chain.
-- KEYS[1]  hash node -> slot (0..25): each live node owns one bit of every mask
-- ARGV[1]  key prefix of the model (all its keys share one hash tag)
-- ARGV[2]  the prompt's router block hashes, concatenated; ARGV[3] bytes per hash
-- Per block hash h: string <prefix>r:h = G + C * 2^26 (bitmasks of the slots holding h on
-- GPU / CPU); string <prefix>q:h = bitmask of slots with a prediction; hash <prefix>x:h =
-- slot -> that prediction's expiry (ms, Redis clock). Bits of slots no live node owns
-- (retired, not yet swept) are ignored. Each tier keeps a running AND of the masks along the
-- chain; a bit leaving it marks that node's prefix length. Blocks are read with MGET in
-- chunks; the walk stops at the first block that no node still matching holds. Expired
-- predictions met on the way are deleted.
-- Returns a flat array: node, gpu, cpu, total, predicted, node, ...
local band, bor, bnot = bit.band, bit.bor, bit.bnot
local sub, tonumber, call = string.sub, tonumber, redis.call
local SPLIT = 67108864 -- 2^26
local CHUNK = 64
local flat = redis.call('HGETALL', KEYS[1])
local live = 0
local name_of, slot_of = {}, {}
for i = 1, #flat, 2 do
  local s = tonumber(flat[i + 1])
  local b = bit.lshift(1, s)
  live = bor(live, b)
  name_of[b] = flat[i]
  slot_of[b] = s
end
local out = {}
if live == 0 then return out end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local prefix, blob, size = ARGV[1], ARGV[2], tonumber(ARGV[3])
local rp, qp, xp = prefix .. 'r:', prefix .. 'q:', prefix .. 'x:'
-- <prefix>qlive lives as long as the longest-lived prediction: without it, skip q: keys.
local any_pred = redis.call('EXISTS', prefix .. 'qlive') == 1
local acc = {live, live, live, live} -- gpu, cpu, total, predicted
local len = {{}, {}, {}, {}}
local pos = 0

local function drop(tier, new)
  local gone = band(acc[tier], bnot(new))
  while gone ~= 0 do
    local low = band(gone, -gone)
    len[tier][low] = pos
    gone = band(gone, bnot(low))
  end
  acc[tier] = new
end

local function expired(h, low, p)
  local x = tonumber(redis.call('HGET', xp .. h, slot_of[low]))
  if x and x > now then return p, false end
  redis.call('HDEL', xp .. h, slot_of[low])
  p = band(p, bnot(low))
  if p == 0 then
    redis.call('DEL', qp .. h)
  else
    redis.call('SET', qp .. h, p, 'KEEPTTL')
  end
  return p, true
end

local n = #blob / size
local first = 0
while first < n and acc[4] ~= 0 do
  local last = math.min(n, first + CHUNK) - 1
  local keys, m = {}, last - first + 1
  for k = 1, m do
    keys[k] = rp .. sub(blob, (first + k - 1) * size + 1, (first + k) * size)
  end
  if any_pred then
    for k = 1, m do keys[m + k] = qp .. sub(keys[k], #rp + 1) end
  end
  local vals = call('MGET', unpack(keys))
  for k = 1, m do
    local v = tonumber(vals[k]) or 0
    local g0 = v % SPLIT
    local g = band(g0, live)
    local c = band((v - g0) / SPLIT, live)
    local held = bor(g, c)
    local seen = held
    local p = any_pred and tonumber(vals[m + k])
    if p then
      -- Predictions matter only for nodes still matching that do not hold the block.
      local want = band(band(p, acc[4]), bnot(held))
      while want ~= 0 do
        local low = band(want, -want)
        local gone
        p, gone = expired(sub(keys[k], #rp + 1), low, p)
        if not gone then seen = bor(seen, low) end
        want = band(want, bnot(low))
      end
    end
    local np = band(acc[4], seen)
    if np ~= acc[4] then drop(4, np) end
    if np == 0 then break end
    local nt = band(acc[3], held)
    if nt ~= acc[3] then drop(3, nt) end
    local ng = band(acc[1], g)
    if ng ~= acc[1] then drop(1, ng) end
    local nc = band(acc[2], c)
    if nc ~= acc[2] then drop(2, nc) end
    pos = pos + 1
  end
  first = last + 1
end
for b, name in pairs(name_of) do
  local r = {}
  for tier = 1, 4 do
    if band(acc[tier], b) ~= 0 then r[tier] = pos else r[tier] = len[tier][b] or 0 end
  end
  if r[4] > 0 then
    out[#out + 1] = name
    out[#out + 1] = r[1]
    out[#out + 1] = r[2]
    out[#out + 1] = r[3]
    out[#out + 1] = r[4]
  end
end
return out
