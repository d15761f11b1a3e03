-- end_stream (ARGV: stream, now, the writer's fence or ''): the version, or false (nothing changed), or
-- {'fenced', fence}.
-- Twin: mcpresume/core/session.py SessionState.end_stream
if not load_meta() then return false end
local n, now = tonumber(ARGV[A]), ARGV[A + 1]
if not fence_ok(ARGV[A + 2]) then return {'fenced', num('fen')} end
if not end_stream(n, now) then return false end
save_streams()
save_meta()
refresh()
publish(meta.ver)
return tonumber(meta.ver)
