-- read (ARGV: after, most events, most bytes, streams...): {version, epoch, gap, complete, more,
-- stream, seq, time, body, ...}, or false.
if not load_meta() then return false end
-- The events key expired (every event older than the window's age limit): evicted, as reap would have.
do
  local counts, touched = new_counts(), {}
  if sync_expired(counts, touched) then
    forget_gone(touched)
    set('ver', num('ver') + 1)
    save_streams()
    save_meta()
    publish(meta.ver)
  end
end
local after, most, most_bytes = tonumber(ARGV[A]), tonumber(ARGV[A + 1]), tonumber(ARGV[A + 2])
local wanted = {}
local all_ended = true
for i = A + 3, #ARGV do
  local n = tonumber(ARGV[i])
  local s = stream(n)
  if s then
    if (s.e or 0) > after then return {tonumber(meta.ver), meta.epoch, 1, 0, 0} end
    if s.v == 1 then all_ended = false end
    wanted[n] = true
  else
    -- gone: complete for a reader that sent all of it, a gap for one that did not (or never known)
    local last = gone_last(n)
    if not last or last > after then return {tonumber(meta.ver), meta.epoch, 1, 0, 0} end
  end
end
local out = {tonumber(meta.ver), meta.epoch, 0, 0, 0}
local events, size, more = 0, 0, false
local from = (after + 1) .. '-0'
while true do
  local batch = redis.call('XRANGE', EV, from, '+', 'COUNT', 256)
  for i = 1, #batch do
    local f = batch[i][2]
    local sn = tonumber(f[2])
    if wanted[sn] then
      local body = f[6]
      if events >= most or (events > 0 and size + #body > most_bytes) then more = true; break end
      out[#out + 1] = sn; out[#out + 1] = seq_of(batch[i][1]); out[#out + 1] = f[4]; out[#out + 1] = body
      events = events + 1; size = size + #body
    end
  end
  if more or #batch < 256 then break end
  from = '(' .. batch[#batch][1]
end
if more then out[5] = 1 elseif all_ended then out[4] = 1 end
return out
