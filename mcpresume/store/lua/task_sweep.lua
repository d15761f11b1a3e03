-- task_sweep (KEYS: the tasks' expiry index, a sorted set; ARGV: now, at most how many): the tasks whose
-- expiry has passed, taken out of the index in one step, so each is counted once, by the replica whose
-- housekeeping round took it, whichever that is. Their hashes expire on their own (PEXPIREAT).
-- Twin: mcpresume/store/tasks.py MemoryTasks.sweep
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
if #gone > 0 then redis.call('ZREM', KEYS[1], unpack(gone)) end
return #gone
