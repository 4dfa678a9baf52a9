-- The Redis clock of the node that holds a model's keys (a cluster routes this call by KEYS),
-- and the model's names epoch.   KEYS[1] names epoch.   Returns {now_ms, epoch}.
local t = redis.call('TIME')
return {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000),
        tonumber(redis.call('GET', KEYS[1]) or '0')}
