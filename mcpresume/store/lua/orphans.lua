-- orphans, for one session (ARGV: owner): JSON {epoch, streams: [[number, origin, pump record, upstream
-- cursor, answered keys], ...]} of its live streams with a pump record, or false.
-- Twin: mcpresume/core/session.py SessionState.orphans
if not load_meta() or meta.own ~= ARGV[A] then return false end
local found = orphans()
if #found == 0 then return false end
return cjson.encode({epoch = meta.epoch, streams = found})
