-- keep_recipe (ARGV: epoch, the recipe the caller read with a leading '=' or '' for none, the new recipe).
-- Compare and set: written only while the session is incarnation epoch and its recipe is still the one the
-- caller read (another request of the session, on any replica, may have written meanwhile). No news: no
-- reader waits on a recipe. Returns 1 written, 0 not.
-- Twin: mcpresume/store/memory.py MemoryStore.keep_recipe
local epoch, expected, recipe = ARGV[A], ARGV[A + 1], ARGV[A + 2]
local current = redis.call('HMGET', META, 'epoch', 'rcp')
if not current[1] or current[1] ~= epoch then return 0 end
local held = ''
if current[2] then held = '=' .. current[2] end
if held ~= expected then return 0 end
redis.call('HSET', META, 'rcp', recipe)
return 1
