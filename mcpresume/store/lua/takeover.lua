-- take_over, for one session (ARGV: owner, new owner): if ``owner`` owns it, the new owner does now (of
-- replicas racing for it, one wins), and its orphans as orphans.lua lists them; else false.
-- Twin: mcpresume/store/memory.py MemoryStore.take_over
if not load_meta() or meta.own ~= ARGV[A] then return false end
redis.call('HSET', META, 'own', ARGV[A + 1])
local found = orphans()
if #found == 0 then return cjson.encode({epoch = meta.epoch, streams = {}}) end
return cjson.encode({epoch = meta.epoch, streams = found})
