-- claim (ARGV: epoch or '', most live streams or '', request keys...): {outcome, stream} or false.
-- Twin: mcpresume/core/session.py SessionState.claim
if not load_meta() or not epoch_ok(ARGV[A]) then return false end
if meta.rt == '1' then return false end  -- retired: new requests find the session unknown
local limit = ARGV[A + 1]
local keys = {}
for i = A + 2, #ARGV do keys[#keys + 1] = ARGV[i] end
local seen = {}
local any_seen, any_new = false, false
for i, key in ipairs(keys) do
  seen[i] = redis.call('HGET', RQ, key)
  if seen[i] then any_seen = true else any_new = true end
end
if not any_seen then
  if limit ~= '' and num('lp') + num('inf') >= tonumber(limit) then return {'limited', ''} end
  for _, key in ipairs(keys) do remember_request(key, 'p') end
  save_meta()
  refresh()
  return {'new', ''}
end
if any_new then return {'conflict', ''} end
for i = 2, #seen do if seen[i] ~= seen[1] then return {'conflict', ''} end end
local value = seen[1]
if value == 'p' then return {'in_flight', ''} end
if value == 'a' then return {'answered', ''} end
if value == 'c' then return {'cancelled', ''} end
local n = tonumber(value)
local s = stream(n)
if s and (s.e or 0) == 0 then return {'attach', value} end
return {'gone', value}
