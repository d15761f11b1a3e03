-- reap, for one session (ARGV: now, session ttl): {'gone'} | {'dropped'} | {'ok', version, counts...}.
-- Twin: mcpresume/core/session.py SessionState.expire, SessionState.idle
if not load_meta() then return {'gone'} end
local now, ttl = tonumber(ARGV[A]), tonumber(ARGV[A + 1])
if num('lp') == 0 and tonumber(meta.la) + ttl <= now then
  drop_all()
  publish(-1)
  return {'dropped'}
end
local counts, touched = new_counts(), {}
local synced = sync_expired(counts, touched)
if evict(now, counts, touched) or synced then
  forget_gone(touched)
  set('ver', num('ver') + 1)
  save_streams()
  save_meta()
  publish(meta.ver)
end
local out = {'ok', tonumber(meta.ver)}
for _, v in ipairs(flat_counts(counts)) do out[#out + 1] = v end
return out
