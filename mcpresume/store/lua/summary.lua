-- summary: what the session inspector shows of a session, as JSON, or false: its meta's epoch, owner, fence,
-- last activity, retired flag, window counts and in-flight ids; the oldest and newest events (stream,
-- seq); each stream's state (number, origin, live, first seq, last seq, delivered); the gone streams; the
-- request ids by what they hold. No body, no credential. A look that changes nothing: no expiry settled,
-- no listener added, nothing published.
-- Twin: mcpresume/store/memory.py MemoryStore.summary
if not load_meta() then return false end
local out = {epoch = meta.epoch, own = meta.own or '', fen = num('fen'), la = meta.la, rt = meta.rt == '1',
  ne = num('ne'), nb = num('nb'), gone = gone_list()}
local oldest = redis.call('XRANGE', EV, '-', '+', 'COUNT', 1)[1]
local newest = redis.call('XREVRANGE', EV, '+', '-', 'COUNT', 1)[1]
if oldest then out.oldest = {entry(oldest).s, seq_of(oldest[1]) + num('hc')} end
if newest then
  local e = entry(newest)
  out.newest = {e.s, e.first + e.c - 1}
end
local st = {}
local raw = redis.call('HGETALL', ST)
for i = 1, #raw, 2 do
  local s = cjson.decode(raw[i + 1])
  st[#st + 1] = {tonumber(raw[i]), s.o, s.v, s.f, s.l, s.d or 0}
end
out.st = st
local pending, answered, streamed = 0, 0, 0
for _, raw in ipairs(redis.call('HVALS', RQ)) do
  local held = claim_of(raw)
  if held == 'p' then pending = pending + 1
  elseif held == 'a' or held == 'c' or held == 'u' then answered = answered + 1
  else streamed = streamed + 1 end
end
out.rq = {pending, answered, streamed}
return cjson.encode(out)
