-- take_over, for one session (ARGV: owner, new owner): if ``owner`` owns it, the new owner does now (of
-- replicas racing for it, one wins) under a new fence (the old owner's writes are refused from now on), and
-- its orphans as orphans.lua lists them; else false.
-- Twin: mcpresume/store/memory.py MemoryStore.take_over
if not load_meta() or meta.own ~= ARGV[A] then return false end
local fence = num('fen') + 1
redis.call('HSET', META, 'own', ARGV[A + 1], 'fen', fence)
local found = orphans()
if #found == 0 then return cjson.encode({epoch = meta.epoch, fence = fence, streams = {}}) end
return cjson.encode({epoch = meta.epoch, fence = fence, streams = found})
