-- task_advance (KEYS: the task's hash; ARGV: the status expected, the new status, the new record, now):
-- a task's compare-and-set. The record replaces the stored one only while its status is still the one
-- the caller read (a cancelled task stays cancelled, a completed one completed); the key keeps its expiry.
-- Twin: mcpresume/store/tasks.py MemoryTasks.advance
local status = redis.call('HGET', KEYS[1], 's')
if status ~= ARGV[1] then return 0 end
-- An expired task is gone, whether or not Redis has dropped its key yet (the callers' clock decides).
if tonumber(ARGV[4]) >= tonumber(redis.call('HGET', KEYS[1], 'e')) then return 0 end
redis.call('HSET', KEYS[1], 's', ARGV[2], 'j', ARGV[3])
return 1
