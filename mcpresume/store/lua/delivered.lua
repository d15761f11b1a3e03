-- mark_delivered (ARGV: seq, streams...).
-- (the meta is only checked, not loaded: a mark comes with every write to a client)
if redis.call('EXISTS', META) == 0 then return 0 end
local seq = tonumber(ARGV[A])
for i = A + 1, #ARGV do
  local n = tonumber(ARGV[i])
  local s = stream(n)
  if s and (s.d or 0) < seq then s.d = seq; mark(n) end
end
save_streams()
return 1
