-- read (ARGV: after, most events, most bytes, streams...): {version, epoch, gap, complete, more,
-- (stream, first seq, time, sizes, BD field, offset) per run of events, ...}, or false. The bodies are not
-- returned: the client takes the run's bytes from offset (0-based), as many as its sizes add up to, of the
-- field's value (HMGET, or its own copy: a field is written once).
-- Twin: mcpresume/core/session.py SessionState.read
if not load_meta() then return false end
settle_expired()
listen(); save_meta()
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
-- The entry holding seq after + 1 may begin before it: the last entry whose first seq is at most that.
local batch = redis.call('XREVRANGE', EV, (after + 1) .. '-0', '-', 'COUNT', 1)
local from = (after + 1) .. '-0'
if #batch == 1 then from = batch[1][1] end
local want = 4
while true do
  batch = redis.call('XRANGE', EV, from, '+', 'COUNT', want)
  for i = 1, #batch do
    local e = entry(batch[i])
    local k = math.max(1, after - e.first + 2)
    if wanted[e.s] and k == 1 and events + e.c <= most
        and (size + e.n <= most_bytes or (events == 0 and e.c == 1)) then
      -- The usual case: the whole entry, as it is (no sizes parsed).
      out[#out + 1] = e.s; out[#out + 1] = e.first; out[#out + 1] = e.ts
      out[#out + 1] = e.z; out[#out + 1] = e.k; out[#out + 1] = 0
      events = events + e.c; size = size + e.n
    elseif wanted[e.s] and e.first + e.c - 1 > after then
      local z = sizes(e)
      local offset = 0
      for j = 1, k - 1 do offset = offset + z[j] end
      local taken = 0
      for j = k, e.c do
        if events >= most or (events > 0 and size + z[j] > most_bytes) then more = true; break end
        taken = taken + 1
        events = events + 1; size = size + z[j]
      end
      if taken > 0 then
        out[#out + 1] = e.s; out[#out + 1] = e.first + k - 1; out[#out + 1] = e.ts
        out[#out + 1] = string.sub(e.z, 4 * k - 3, 4 * (k + taken - 1))
        out[#out + 1] = e.k; out[#out + 1] = offset
      end
      if more then break end
    end
  end
  if more or #batch < want then break end
  from = '(' .. batch[#batch][1]
  want = math.min(64, want * 2)
end
if more then out[5] = 1 elseif all_ended then out[4] = 1 end
return out
