-- orphans, for one session (ARGV: owner): JSON {epoch, fence, streams: [[number, origin, pump record, upstream
-- cursor, answered keys], ...]} of its live streams with a pump record, or false. The owner's new process
-- adopts them under a new fence: a process of the same replica still writing (paused, not dead) is refused.
-- Twin: mcpresume/core/session.py SessionState.orphans
if not load_meta() or meta.own ~= ARGV[A] then return false end
local found = orphans()
if #found == 0 then return false end
local fence = num('fen') + 1
redis.call('HSET', META, 'fen', fence)
return cjson.encode({epoch = meta.epoch, fence = fence, streams = found})
