-- Residency match: one round trip, walking the prompt's block chain. Reads only.
-- KEYS[1]  hash node -> slot (0..25): each live node owns one bit of every mask
-- ARGV[1]  key prefix of the model (all its keys share one hash tag)
-- ARGV[2]  the prompt's router block hashes, concatenated; ARGV[3] bytes per hash
-- Per block hash h: string <prefix>r:h = G + C * 2^26 (bitmasks of the slots holding h on
-- GPU / CPU); string <prefix>p:h = the predictions of h, one 16-byte entry per slot: the slot
-- (2 digits) then its expiry (14 digits, ms on the Redis clock); entries may have expired.
-- Bits of slots no live node owns (retired, not yet swept) are ignored. Each tier keeps a
-- running AND of the masks along the chain; a bit leaving it marks that node's prefix length.
-- Residency values are read with MGET in growing chunks; prediction entries only for blocks that a
-- node still matching does not hold, in windows. A block whose values equal the previous
-- block's changes nothing and is skipped unparsed. The walk stops at the first block that no
-- node still matching holds or has predicted.
-- Returns a flat array: node, gpu, cpu, total, predicted, node, ...
local band, bor, bnot, lshift = bit.band, bit.bor, bit.bnot, bit.lshift
local sub, tonumber, call = string.sub, tonumber, redis.call
local SPLIT = 67108864 -- 2^26
local CHUNK, CHUNK_MAX = 32, 256 -- blocks per MGET of residency values, doubling as it walks
local QWINDOW = 16 -- blocks per MGET of prediction entries (read only where needed)
local ENTRY = 16 -- bytes per prediction entry
local flat = call('HGETALL', KEYS[1])
local live = 0
local name_of = {}
for i = 1, #flat, 2 do
  local b = lshift(1, tonumber(flat[i + 1]))
  live = bor(live, b)
  name_of[b] = flat[i]
end
local out = {}
if live == 0 then return out end
local t = call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local prefix, blob, size = ARGV[1], ARGV[2], tonumber(ARGV[3])
local rp, pp = prefix .. 'r:', prefix .. 'p:'
-- <prefix>plive lives as long as the longest-lived prediction: without it, skip p: keys.
local any_pred = call('EXISTS', prefix .. 'plive') == 1
local acc = {live, live, live, live} -- gpu, cpu, total, predicted
local len = {{}, {}, {}, {}}
local pos = 0
-- Values of the last block parsed, when skipping an equal block is exact: same_r its
-- residency; same_p false if every node still matching held it, else its prediction entries.
local same_r, same_p = nil, false

local function drop(tier, new)
  local gone = band(acc[tier], bnot(new))
  while gone ~= 0 do
    local low = band(gone, -gone)
    len[tier][low] = pos
    gone = band(gone, bnot(low))
  end
  acc[tier] = new
end

-- Bits of `need` with a live prediction in entries `pv` (a string, or false when none).
local function predicted(pv, need)
  local keep = 0
  if pv then
    for i = 1, #pv, ENTRY do
      local b = lshift(1, tonumber(sub(pv, i, i + 1)))
      if band(b, need) ~= 0 and tonumber(sub(pv, i + 2, i + ENTRY - 1)) > now then
        keep = bor(keep, b)
      end
    end
  end
  return keep
end

local n = #blob / size
local first = 0
while first < n and acc[4] ~= 0 do
  local last = math.min(n, first + CHUNK) - 1
  CHUNK = math.min(CHUNK_MAX, CHUNK * 2)
  local m = last - first + 1
  local hs, keys = {}, {}
  for k = 1, m do
    local h = sub(blob, (first + k - 1) * size + 1, (first + k) * size)
    hs[k] = h
    keys[k] = rp .. h
  end
  local vals = call('MGET', unpack(keys))
  local pvals, pfrom, pto = nil, 0, -1 -- prediction entries of blocks pfrom..pto-1 of the chunk
  local function pval(k)
    if k >= pto then
      -- One block where a node drops out; a window where a run of predictions goes on.
      local w = 1
      if k == pto then w = QWINDOW end
      pfrom, pto = k, math.min(m + 1, k + w)
      local pkeys = {}
      for j = pfrom, pto - 1 do pkeys[j - pfrom + 1] = pp .. hs[j] end
      pvals = call('MGET', unpack(pkeys))
    end
    return pvals[k - pfrom + 1]
  end
  for k = 1, m do
    local rv = vals[k]
    if rv == same_r and (not same_p or pval(k) == same_p) then
      pos = pos + 1 -- the running ANDs already lie within this block's masks
    else
      local v = tonumber(rv) or 0
      local g0 = v % SPLIT
      local g = band(g0, live)
      local c = band((v - g0) / SPLIT, live)
      local held = bor(g, c)
      local seen = held
      local pv = false
      -- Predictions matter only for nodes still matching that do not hold the block.
      local need = any_pred and band(acc[4], bnot(held)) or 0
      if need ~= 0 then
        pv = pval(k)
        seen = bor(held, predicted(pv, need))
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
      same_r = rv
      if band(np, bnot(held)) == 0 then same_p = false else same_p = pv end
      pos = pos + 1
    end
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
