-- group_streams (ARGV: streams...).
-- Twin: mcpresume/core/session.py SessionState.group_streams
if not load_meta() then return 0 end
local members, order = {}, {}
local lost = 0
for i = A, #ARGV do
  local n = tonumber(ARGV[i])
  local s = stream(n)
  if s then
    if not members[n] then members[n] = true; order[#order + 1] = n end
    for _, m in ipairs(s.g) do if not members[m] then members[m] = true; order[#order + 1] = m end end
    if (s.gl or 0) > lost then lost = s.gl end
  end
end
table.sort(order)
for _, n in ipairs(order) do
  local s = stream(n)
  if s then
    local g = {}
    for _, m in ipairs(order) do if m ~= n then g[#g + 1] = m end end
    s.g = g
    if lost > (s.gl or 0) then s.gl = lost end
    mark(n)
  end
end
save_streams()
return 1
