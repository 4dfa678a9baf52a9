-- Apply translated residency operations of one node (one bounded chunk of a batch).
-- KEYS[1] hash node -> slot   KEYS[2] hash slot -> node   KEYS[3] set of known nodes
-- KEYS[4] set of retired slots   KEYS[5] set of free slots   KEYS[6] slots ever handed out
-- KEYS[7] names epoch (bumped when a slot is retired)   KEYS[8] the node's engine-hash map
-- KEYS[9] its last applied sequence   KEYS[10] its lease   KEYS[11] <tag>:res
-- ARGV[1] node; ARGV[2] most slots per model; ARGV[3] the writer ("" when no lease is used:
-- otherwise the call is refused with NOTOWNER, writing nothing, unless the lease names it);
-- then operations:
--   "S", tier ("G"/"C"), ids -- these blocks (8-byte ids, packed) became resident
--   "R", tier, ids           -- these blocks left the tier
--   "C"                      -- cleared: the node's slot is retired (its entries are ignored
--                               at once and scrubbed by a sweep before the slot is reused)
--   "X"                      -- the engine-hash map is emptied
--   "M", field, value        -- one engine-hash map entry set
--   "D", field               -- one engine-hash map entry dropped
--   "Q", seq                 -- the node's last applied batch
-- Residency of a block (a field of <tag>:res) is a bitmap: bit 2*slot (little-endian: byte
-- slot/4, bit 2*(slot%4) of it) set while the slot holds it on GPU, bit 2*slot+1 on CPU; no
-- trailing zero bytes, and a field left empty is deleted. A node gets a slot when it first
-- stores (a swept free one, else a new one). Fails with NOSLOT, before writing anything, when
-- it needs a slot and none is left.
local call = redis.call
local node, max_slots, writer = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local WIDTH = {S = 3, R = 3, C = 1, X = 1, M = 3, D = 2, Q = 2}
if writer ~= '' and call('GET', KEYS[10]) ~= writer then
  return redis.error_reply('NOTOWNER another replica writes the events of ' .. node)
end
local slot = tonumber(call('HGET', KEYS[1], node))
local has, need = slot ~= nil, false
local i = 4
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'C' then has = false end
  if op == 'S' and not has then need, has = true, true end
  i = i + WIDTH[op]
end
if need and call('SCARD', KEYS[5]) == 0 and (tonumber(call('GET', KEYS[6])) or 0) >= max_slots then
  return redis.error_reply('NOSLOT no free node slot; retired slots need a sweep')
end
call('SADD', KEYS[3], node)

local sub, byte, char, band, bor = string.sub, string.byte, string.char, bit.band, bit.bor
local RES = KEYS[11]

-- Set (add) or clear (not add) bit ``mask`` of byte ``at`` of block ``id``'s bitmap.
local function update(id, at, mask, add)
  local v = call('HGET', RES, id)
  if not v then
    if add then call('HSET', RES, id, string.rep('\0', at - 1) .. char(mask)) end
    return
  end
  local b = byte(v, at) or 0
  if add then
    if band(b, mask) ~= 0 then return end
    if #v < at then
      v = v .. string.rep('\0', at - 1 - #v) .. char(mask)
    else
      v = sub(v, 1, at - 1) .. char(bor(b, mask)) .. sub(v, at + 1)
    end
    call('HSET', RES, id, v)
  elseif band(b, mask) ~= 0 then
    v = string.gsub(sub(v, 1, at - 1) .. char(b - mask) .. sub(v, at + 1), '%z+$', '')
    if v == '' then call('HDEL', RES, id) else call('HSET', RES, id, v) end
  end
end

i = 4
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'C' then
    if slot then
      call('SADD', KEYS[4], slot)
      call('HDEL', KEYS[1], node)
      call('HDEL', KEYS[2], slot)
      call('INCR', KEYS[7])
      slot = nil
    end
  elseif op == 'X' then
    call('DEL', KEYS[8])
  elseif op == 'M' then
    call('HSET', KEYS[8], ARGV[i + 1], ARGV[i + 2])
  elseif op == 'D' then
    call('HDEL', KEYS[8], ARGV[i + 1])
  elseif op == 'Q' then
    call('SET', KEYS[9], ARGV[i + 1])
  else
    if op == 'S' and not slot then
      slot = tonumber(call('SPOP', KEYS[5])) or (call('INCR', KEYS[6]) - 1)
      call('HSET', KEYS[1], node, slot)
      call('HSET', KEYS[2], slot, node)
    end
    if slot then
      local at = math.floor(slot / 4) + 1
      local mask = 2 ^ ((2 * slot) % 8 + (ARGV[i + 1] == 'G' and 0 or 1))
      local add = op == 'S'
      local ids = ARGV[i + 2]
      for j = 1, #ids, 8 do update(sub(ids, j, j + 7), at, mask, add) end
    end
  end
  i = i + WIDTH[op]
end
return slot
