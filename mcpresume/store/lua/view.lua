-- view (ARGV: stream): the facts of the resume decision, as JSON, or false.
-- Twin: mcpresume/core/session.py SessionState.view
if not load_meta() then return false end
settle_expired()
listen(); save_meta()
local n = tonumber(ARGV[A])
local out = {epoch = meta.epoch, la = meta.la, lp = num('lp'), nst = num('nst'), nseq = num('nseq')}
local oldest = redis.call('XRANGE', EV, '-', '+', 'COUNT', 1)[1]
local newest = redis.call('XREVRANGE', EV, '+', '-', 'COUNT', 1)[1]
if oldest then out.oldest = {entry(oldest).s, seq_of(oldest[1]) + num('hc')} end
if newest then
  local e = entry(newest)
  out.newest = {e.s, e.first + e.c - 1}
end
local s = stream(n)
if s then
  out.st = s
  local ge = s.gl or 0
  for _, m in ipairs(s.g) do
    local other = stream(m)
    if other and (other.e or 0) > ge then ge = other.e end
  end
  out.ge = ge
elseif meta.gs and meta.gs ~= '' then
  local gs = cjson.decode(meta.gs)
  if gs[1] == n then out.gs = gs end
end
return cjson.encode(out)
