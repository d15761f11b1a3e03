-- mark_delivered (ARGV: seq, streams...).
-- (the meta is only checked, not loaded: a mark comes with every write to a client)
-- Twin: mcpresume/core/session.py SessionState.mark_delivered
if redis.call('EXISTS', META) == 0 then return 0 end
local seq = tonumber(ARGV[A])
for i = A + 1, #ARGV do mark_delivered(tonumber(ARGV[i]), seq) end
save_streams()
return 1
