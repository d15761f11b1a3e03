-- touch (ARGV: now, then the session's delivery mark when the touch carries it: seq, streams...): client
-- activity; the mark applied as delivered.lua applies it (one script where the two were two).
-- Twin: mcpresume/store/memory.py MemoryStore.touch, MemoryStore.mark_delivered
local last = redis.call('HGET', META, 'la')
if not last then return 0 end
if tonumber(last) < tonumber(ARGV[A]) then redis.call('HSET', META, 'la', ARGV[A]) end
if #ARGV > A then
  local seq = tonumber(ARGV[A + 1])
  for i = A + 2, #ARGV do mark_delivered(tonumber(ARGV[i]), seq) end
  save_streams()
end
refresh()
return 1
