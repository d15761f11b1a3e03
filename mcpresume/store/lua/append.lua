-- append (ARGV: expected last seq of the stream or '', stream, now, upstream cursor or '', guard JSON or '',
-- answered request keys JSON or '', bodies...): {'ok', version, last seq, counts...} | {'gone'} |
-- {'noop'} | {'stale', last seq} | {'blocked', reader indexes...}.
if not load_meta() then return {'gone'} end
local expected, n, now = ARGV[A], tonumber(ARGV[A + 1]), ARGV[A + 2]
local upstream_cursor, guard, answered = ARGV[A + 3], ARGV[A + 4], ARGV[A + 5]
local first_body = A + 6
local count = #ARGV - first_body + 1
local s = stream(n)
if s and s.v == 1 and expected ~= '' and tonumber(expected) ~= s.l then return {'stale', s.l} end
local size = 0
for i = first_body, #ARGV do size = size + #ARGV[i] end
local counts, touched = new_counts(), {}
sync_expired(counts, touched)
if guard ~= '' then
  -- SessionState.room_for, for every reader at once: what appending would evict by count or bytes.
  local g = cjson.decode(guard)
  local readers, keep = g.r, g.k
  local events, held = num('ne') + count, num('nb') + size
  if events > MAX_EVENTS or held > MAX_BYTES then
    local blocked, keep_blocked = {}, false
    local from = '-'
    local done = false
    local want = math.min(128, math.max(1, events - MAX_EVENTS) + 1)
    while not done do
      local batch = redis.call('XRANGE', EV, from, '+', 'COUNT', want)
      for i = 1, #batch do
        if events <= MAX_EVENTS and held <= MAX_BYTES then done = true; break end
        local f = batch[i][2]
        local sn, seq = tonumber(f[2]), seq_of(batch[i][1])
        if keep then
          local other = stream(sn)
          if other and seq > (other.d or 0) then keep_blocked = true end
        end
        for index, reader in ipairs(readers) do
          if not blocked[index] and seq > reader[2] then
            for _, followed in ipairs(reader[1]) do
              if followed == sn then blocked[index] = true; break end
            end
          end
        end
        events = events - 1; held = held - #f[6]
      end
      if #batch < want then done = true else from = '(' .. batch[#batch][1]; want = math.min(128, want * 2) end
    end
    local out = {'blocked'}
    for index = 1, #readers do if blocked[index] then out[#out + 1] = index - 1 end end
    if #out > 1 or keep_blocked then return out end
  end
end
if s and s.v == 1 and upstream_cursor ~= '' then s.u = upstream_cursor; mark(n) end
if not s or s.v == 0 or count <= 0 then
  save_streams()
  return {'noop'}
end
if answered ~= '' then
  if type(s.a) ~= 'table' then s.a = {} end
  for _, key in ipairs(cjson.decode(answered)) do s.a[#s.a + 1] = key end
end
local seq = num('nseq')
for i = first_body, #ARGV do
  redis.call('XADD', EV, seq .. '-0', 's', n, 't', now, 'b', ARGV[i])
  seq = seq + 1
end
set('nseq', seq)
s.l = seq - 1
mark(n)
set('ver', num('ver') + 1)
set('ne', num('ne') + count); set('nb', num('nb') + size)
if evict(tonumber(now), counts, touched) or next(touched) then forget_gone(touched) end
save_streams()
save_meta()
refresh()
publish(meta.ver)
local out = {'ok', tonumber(meta.ver), s.l}
for _, v in ipairs(flat_counts(counts)) do out[#out + 1] = v end
return out
