-- Hand swept slots back: KEYS[1] set of retired slots, KEYS[2] set of free slots,
-- KEYS[3] names epoch; ARGV the slots a sweep scrubbed from every key.
for i = 1, #ARGV do
  if redis.call('SREM', KEYS[1], ARGV[i]) == 1 then redis.call('SADD', KEYS[2], ARGV[i]) end
end
redis.call('INCR', KEYS[3])
return #ARGV
