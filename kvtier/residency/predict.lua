-- Speculative residency of one node, expiring after a TTL (server clock); one bounded chunk.
-- KEYS[1] hash node -> slot   KEYS[2] hash slot -> node   KEYS[3] set of known nodes
-- KEYS[4] set of retired slots (unused here)   KEYS[5] set of free slots
-- KEYS[6] slots ever handed out   KEYS[7] names epoch (unused here)
-- KEYS[8] <tag>:pred (block id -> entries)   KEYS[9] <tag>:pgc (its clean-up scan's cursor)
-- ARGV[1] node; ARGV[2] most slots per model; ARGV[3] ttl in ms; ARGV[4] block ids (8 bytes
-- each).
-- A field holds one 16-byte entry per predicting slot: the slot (2 bytes, big-endian) then
-- its expiry (14 digits, ms on the Redis clock). The node's entry replaces its older one,
-- expired entries are dropped, and the hash expires with its longest-lived prediction. Fields
-- not written again are cleaned by a scan that visits about as many fields per call as the
-- call writes, so the hash stays near its live size. Fails with NOSLOT like apply.lua.
local sub, char, call, tonumber = string.sub, string.char, redis.call, tonumber
local ENTRY = 16
local node, max_slots, ttl, ids = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local slot = tonumber(call('HGET', KEYS[1], node))
if not slot then
  slot = tonumber(call('SPOP', KEYS[5]))
  if not slot then
    if (tonumber(call('GET', KEYS[6])) or 0) >= max_slots then
      return redis.error_reply('NOSLOT no free node slot; retired slots need a sweep')
    end
    slot = call('INCR', KEYS[6]) - 1
  end
  call('HSET', KEYS[1], node, slot)
  call('HSET', KEYS[2], slot, node)
end
call('SADD', KEYS[3], node)
local t = call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ss = char(math.floor(slot / 256), slot % 256)
local entry = ss .. string.format('%014d', now + ttl)

-- ``old`` without expired entries and without ``drop``'s (nil: keep every slot's).
local function live(old, drop)
  local keep = {}
  for i = 1, #old, ENTRY do
    if sub(old, i, i + 1) ~= drop and tonumber(sub(old, i + 2, i + ENTRY - 1)) > now then
      keep[#keep + 1] = sub(old, i, i + ENTRY - 1)
    end
  end
  return keep
end

local n = #ids / 8
for j = 1, #ids, 8 do
  local f = sub(ids, j, j + 7)
  local old = call('HGET', KEYS[8], f)
  local keep = old and live(old, ss) or {}
  keep[#keep + 1] = entry
  call('HSET', KEYS[8], f, table.concat(keep))
end
if call('PTTL', KEYS[8]) < ttl then call('PEXPIRE', KEYS[8], ttl) end
local scan = call('HSCAN', KEYS[8], call('GET', KEYS[9]) or '0', 'COUNT', math.max(n, 16))
local found = scan[2]
for i = 1, #found, 2 do
  local f, v = found[i], found[i + 1]
  local keep = live(v, nil)
  if #keep == 0 then
    call('HDEL', KEYS[8], f)
  elseif #keep * ENTRY ~= #v then
    call('HSET', KEYS[8], f, table.concat(keep))
  end
end
call('SET', KEYS[9], scan[1])
return slot
