-- touch (ARGV: now): client activity.
-- Twin: mcpresume/store/memory.py MemoryStore.touch
local last = redis.call('HGET', META, 'la')
if not last then return 0 end
if tonumber(last) < tonumber(ARGV[A]) then redis.call('HSET', META, 'la', ARGV[A]) end
refresh()
return 1
