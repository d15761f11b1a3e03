-- delete_session (ARGV: epoch or '').
-- Twin: mcpresume/store/memory.py MemoryStore.delete_session
local current = redis.call('HGET', META, 'epoch')
if not current or (ARGV[A] ~= '' and current ~= ARGV[A]) then return 0 end
drop_all()
publish(-1)
return 1
