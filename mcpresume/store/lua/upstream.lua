-- map_upstream (ARGV: epoch, the upstream id the caller saw with a leading '=' or '' for the client's own,
-- the upstream's new id). Compare and set: one replica wins the re-initialization of a session, so it has
-- one upstream session (the loser ends its own). Returns 1 mapped, 0 not.
-- Twin: mcpresume/store/memory.py MemoryStore.map_upstream
local epoch, expected, uid = ARGV[A], ARGV[A + 1], ARGV[A + 2]
local current = redis.call('HMGET', META, 'epoch', 'uid')
if not current[1] or current[1] ~= epoch then return 0 end
local held = ''
if current[2] then held = '=' .. current[2] end
if held ~= expected then return 0 end
redis.call('HSET', META, 'uid', uid)
return 1
