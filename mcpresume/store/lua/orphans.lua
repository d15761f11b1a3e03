-- orphaned_streams, for one session (ARGV: owner): JSON list of its live streams, or false.
if not load_meta() or meta.own ~= ARGV[A] then return false end
local found = {}
local raw = redis.call('HGETALL', ST)
for i = 1, #raw, 2 do
  local n = tonumber(raw[i])
  local s = stream(n)
  if s and s.v == 1 then
    local pending = {}
    for _, key in ipairs(s.k) do
      if redis.call('HGET', RQ, key) == tostring(n) then pending[#pending + 1] = key end
    end
    found[#found + 1] = {n, s.o, s.u, pending}
  end
end
if #found == 0 then return false end
return cjson.encode(found)
