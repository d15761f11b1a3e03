-- take_over, for one session (ARGV: owner, new owner): if ``owner`` owns it, the new owner does now (of
-- replicas racing for it, one wins), and its orphans as orphans.lua lists them; else false.
if not load_meta() or meta.own ~= ARGV[A] then return false end
redis.call('HSET', META, 'own', ARGV[A + 1])
local found = {}
local raw = redis.call('HGETALL', ST)
for i = 1, #raw, 2 do
  local n = tonumber(raw[i])
  local s = stream(n)
  if s and s.v == 1 and s.pm and s.pm ~= '' then
    found[#found + 1] = {n, s.o, s.pm, s.u, s.a or {}}
  end
end
if #found == 0 then return cjson.encode({epoch = meta.epoch, streams = {}}) end
table.sort(found, function(x, y) return x[1] < y[1] end)  -- in the order they were opened
return cjson.encode({epoch = meta.epoch, streams = found})
