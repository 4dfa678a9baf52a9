-- Speculative residency of one node, expiring after a TTL (server clock); one bounded chunk.
-- KEYS[1] hash node -> slot   KEYS[2] hash slot -> node   KEYS[3] set of known nodes
-- KEYS[4] set of retired slots (unused here)   KEYS[5] set of free slots
-- KEYS[6] slots ever handed out   KEYS[7] names epoch (unused here)   KEYS[8] <tag>:plive
-- KEYS[9..] prediction keys <tag>:p:<h>
-- ARGV[1] node; ARGV[2] most slots per model; ARGV[3] ttl in ms.
-- <tag>:p:h holds one 16-byte entry per predicting slot: the slot (2 bytes, big-endian) then
-- its expiry (14 digits, ms on the Redis clock). The node's entry replaces its older one,
-- expired entries are dropped, and the key expires with its longest-lived prediction, as does
-- <tag>:plive (without it, match skips prediction keys). Fails with NOSLOT like apply.lua.
local sub, byte, char, call, tonumber = string.sub, string.byte, string.char, redis.call, tonumber
local ENTRY = 16
local node, max_slots, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
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
if call('PTTL', KEYS[8]) < ttl then
  call('SET', KEYS[8], '1', 'PX', ttl)
end
for k = 9, #KEYS do
  local key = KEYS[k]
  local pttl = call('PTTL', key) -- -2 when new; never -1: p: keys always carry a TTL
  local old = call('GET', key)
  local keep = {}
  if old then
    for i = 1, #old, ENTRY do
      if sub(old, i, i + 1) ~= ss and tonumber(sub(old, i + 2, i + ENTRY - 1)) > now then
        keep[#keep + 1] = sub(old, i, i + ENTRY - 1)
      end
    end
  end
  keep[#keep + 1] = entry
  if pttl < ttl then
    call('SET', key, table.concat(keep), 'PX', ttl)
  else
    call('SET', key, table.concat(keep), 'KEEPTTL')
  end
end
return slot
