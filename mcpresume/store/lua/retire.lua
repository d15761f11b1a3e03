-- retire (ARGV: epoch): the session's upstream does not know it: claims find it unknown from now on.
-- Twin: mcpresume/store/memory.py MemoryStore.retire
local current = redis.call('HGET', META, 'epoch')
if not current or current ~= ARGV[A] then return 0 end
redis.call('HSET', META, 'rt', 1)
return 1
