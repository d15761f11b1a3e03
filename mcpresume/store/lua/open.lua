-- open_stream (ARGV: epoch or '', origin, now, primed '1'/'0', priming block, pump record (JSON, kept as
-- an opaque string) or '', request keys...): {number, epoch, priming seq, version, fence, the stream's last
-- seq evicted} or false. The fence is the one the stream's pump writes under (common.lua fence_ok); the last
-- seq evicted: 0 unless the window could not hold its priming event (this process's copies: copies.py).
-- Twin: mcpresume/core/session.py SessionState.open_stream
if not load_meta() or not epoch_ok(ARGV[A]) then return false end
local origin, now, primed, block = ARGV[A + 1], ARGV[A + 2], ARGV[A + 3] == '1', ARGV[A + 4]
local pump = ARGV[A + 5]
local keys = {}
for i = A + 6, #ARGV do keys[#keys + 1] = ARGV[i] end
local n = num('nst')
set('nst', n + 1)
local seq = num('nseq')
local s = {o = origin, f = seq, l = seq - 1, v = 1, d = 0, g = {}, gl = 0, p = primed and 1 or 0, e = 0,
  u = '', k = keys, pm = pump, a = {}}
streams[n] = s; mark(n)
for _, key in ipairs(keys) do remember_request(key, n) end
if origin == 'get' then set('sa', n) else set('lp', num('lp') + 1) end
set('la', now)
set('ver', num('ver') + 1)
if primed then
  local counts, touched = new_counts(), {}
  sync_expired(counts, touched)
  local field = meta.epoch .. ':' .. seq  -- unique: the epoch is random (mcpresume/store/copies.py)
  redis.call('HSET', BD, field, block)  -- a few bytes: through Lua is cheap
  add_entry(seq, n, now, 1, struct.pack('<I4', #block), field, #block)
  s.l = seq
  set('nseq', seq + 1)
  set('ne', num('ne') + 1); set('nb', num('nb') + #block)
  if evict(tonumber(now), counts, touched) or next(touched) then forget_gone(touched) end
end
save_streams()
listen()
save_meta()
refresh()
publish(meta.ver)
return {n, meta.epoch, seq, tonumber(meta.ver), num('fen'), s.e or 0}
