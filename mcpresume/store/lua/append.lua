-- append (ARGV: expected last seq of the stream or '', stream, now, upstream cursor or '', guard JSON or '',
-- answered request keys JSON or '', event count, their sizes (4 bytes little-endian each), the BD field the client set
-- to their bodies (concatenated) in the same MULTI, their bytes, a delivery mark '<seq> <stream> ...' or ''
-- (applied first: delivered.lua's, carried), the writer's fence or '' (unfenced), '1' to end the stream once
-- the events are in (end.lua's, in the same call: its last events) or '':
-- {'ok', version, last seq, counts..., the stream's last seq evicted} | {'gone'} | {'noop'} | {'stale', last seq} |
-- {'blocked', (reader index, seq it must reach)...} | {'fenced', the session's fence}. Unless 'ok', the bodies' field is deleted (each call has a field of its own).
-- Twin: mcpresume/core/session.py SessionState.append_run, SessionState.refusal, SessionState.end_stream
local expected, n, now = ARGV[A], tonumber(ARGV[A + 1]), ARGV[A + 2]
local upstream_cursor, guard, answered = ARGV[A + 3], ARGV[A + 4], ARGV[A + 5]
local count, lengths, body, size = tonumber(ARGV[A + 6]), ARGV[A + 7], ARGV[A + 8], tonumber(ARGV[A + 9])
if not load_meta({'epoch', 'nseq', 'ver', 'ne', 'nb', 'hc', 'hb', 'rx', 'ls', 'fen'}) then redis.call('DEL', BD); return {'gone'} end
local marked, synced = false, false
if ARGV[A + 10] ~= '' then
  local seq = nil
  for v in string.gmatch(ARGV[A + 10], '%d+') do
    if seq == nil then seq = tonumber(v) else mark_delivered(tonumber(v), seq); marked = true end
  end
end
local function refused(reply)
  if body ~= '' then redis.call('HDEL', BD, body) end
  if marked and not synced then save_streams() end  -- the mark stands (a window found expired: redone later)
  return reply
end
if not fence_ok(ARGV[A + 11]) then return refused({'fenced', num('fen')}) end
local s = stream(n)
if s and s.v == 1 and expected ~= '' and tonumber(expected) ~= s.l then return refused({'stale', s.l}) end
local counts, touched = new_counts(), {}
synced = sync_expired(counts, touched)
if guard ~= '' then
  -- SessionState.room_for, for every reader at once: what appending would evict by count or bytes.
  local g = cjson.decode(guard)
  local readers, keep = g.r, g.k
  local events, held = num('ne') + count, num('nb') + size
  if events > MAX_EVENTS or held > MAX_BYTES then
    local blocked, keep_blocked = {}, false
    local from = '-'
    local done = false
    local skip = num('hc')  -- the oldest entry's events evicted already
    local want = 2
    while not done do
      local batch = redis.call('XRANGE', EV, from, '+', 'COUNT', want)
      for i = 1, #batch do
        local e = entry(batch[i])
        local other = keep and stream(e.s) or nil
        local avail = e.c - skip
        if events <= MAX_EVENTS and held <= MAX_BYTES then done = true; break end
        if events - avail >= MAX_EVENTS then
          -- all of it would go (by count alone): what its last event says holds for it all
          local last = e.first + e.c - 1
          if other and last > (other.d or 0) then keep_blocked = true end
          for index, reader in ipairs(readers) do
            if last > reader[2] then
              for _, followed in ipairs(reader[1]) do
                if followed == e.s then blocked[index] = last; break end
              end
            end
          end
          events = events - avail
          held = held - (skip == 0 and e.n or e.n - num('hb'))
          skip = e.c
        end
        local z = skip < e.c and sizes(e) or nil
        for k = skip + 1, e.c do
          if events <= MAX_EVENTS and held <= MAX_BYTES then done = true; break end
          local seq = e.first + k - 1
          if other and seq > (other.d or 0) then keep_blocked = true end
          for index, reader in ipairs(readers) do
            if seq > reader[2] then
              for _, followed in ipairs(reader[1]) do
                if followed == e.s then blocked[index] = seq; break end
              end
            end
          end
          events = events - 1; held = held - z[k]
        end
        skip = 0
        if done then break end
      end
      if done or #batch < want then done = true else from = '(' .. batch[#batch][1]; want = math.min(16, want * 2) end
    end
    -- per reader in the way: its index and the last of its events this append would evict (the seq it must
    -- have sent before a retry can pass, Appended.needs)
    local out = {'blocked'}
    for index = 1, #readers do
      if blocked[index] then out[#out + 1] = index - 1; out[#out + 1] = blocked[index] end
    end
    if #out > 1 or keep_blocked then return refused(out) end
  end
end
if s and s.v == 1 and upstream_cursor ~= '' then s.u = upstream_cursor; mark(n) end
if not s or s.v == 0 or count <= 0 then
  save_streams()
  return refused({'noop'})
end
if answered ~= '' then
  if type(s.a) ~= 'table' then s.a = {} end
  for _, key in ipairs(cjson.decode(answered)) do s.a[#s.a + 1] = key end
end
local seq = num('nseq')
add_entry(seq, n, now, count, lengths, body, size)
seq = seq + count
set('nseq', seq)
s.l = seq - 1
mark(n)
set('ver', num('ver') + 1)
set('ne', num('ne') + count); set('nb', num('nb') + size)
if evict(tonumber(now), counts, touched) or next(touched) then forget_gone(touched) end
local ending = ARGV[A + 12] == '1' and end_stream(n, now)
refresh(not ending)  -- as end.lua refreshes
listen()
save_streams()
save_meta()
publish(meta.ver)
local out = {'ok', tonumber(meta.ver), s.l}
for _, v in ipairs(flat_counts(counts)) do out[#out + 1] = v end
out[#out + 1] = s.e or 0  -- the stream's last seq evicted (this process's copies of its appends: copies.py)
return out
