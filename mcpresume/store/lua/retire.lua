-- retire (ARGV: epoch, the writer's fence or ''): the session's upstream does not know it: claims find it
-- unknown from now on. 1, or 0 (another incarnation, or another owner's fence).
-- Twin: mcpresume/store/memory.py MemoryStore.retire
local current, fence = unpack(redis.call('HMGET', META, 'epoch', 'fen'))
if not current or current ~= ARGV[A] then return 0 end
local mine = ARGV[A + 1]
if mine ~= nil and mine ~= '' and tonumber(fence or 0) ~= tonumber(mine) then return 0 end
redis.call('HSET', META, 'rt', 1)
return 1
