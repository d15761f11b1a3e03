-- accept_credential (ARGV: epoch, digest hex, protocol version or '', most digests kept).
-- Twin: mcpresume/core/session.py SessionState.accept_credential
local epoch, digest, pv, most = ARGV[A], ARGV[A + 1], ARGV[A + 2], tonumber(ARGV[A + 3])
if not load_meta() or meta.epoch ~= epoch or meta.cred == '' then return 0 end
local list = {}
for d in string.gmatch(meta.cred, '[^,]+') do list[#list + 1] = d end
if list[#list] ~= digest then
  local kept = {}
  for _, d in ipairs(list) do if d ~= digest then kept[#kept + 1] = d end end
  kept[#kept + 1] = digest
  while #kept > most do table.remove(kept, 1) end
  set('cred', table.concat(kept, ','))
end
if pv ~= '' and pv ~= meta.pv then set('pv', pv) end
save_meta()
return 1
