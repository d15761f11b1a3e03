-- end_stream (ARGV: stream, now, the writer's fence or ''): the version, or false (nothing changed), or
-- {'fenced', fence}.
-- Twin: mcpresume/core/session.py SessionState.end_stream
if not load_meta() then return false end
local n, now = tonumber(ARGV[A]), ARGV[A + 1]
if not fence_ok(ARGV[A + 2]) then return {'fenced', num('fen')} end
local s = stream(n)
if not s or s.v == 0 then return false end
s.v = 0; mark(n)
-- what only resuming it upstream needed (orphans lists live streams only): the pump record, with the client's
-- credentials, is not kept past the stream's end (SessionState.end_stream)
s.pm = nil; s.u = nil; s.a = nil
if meta.sa == tostring(n) then set('sa', '') end
if s.o == 'post' then set('lp', num('lp') - 1) end
set('ver', num('ver') + 1)
-- never backwards (as touch): a stream given up as unattended ends as of when it was last read or fed
if tonumber(meta.la) < tonumber(now) then set('la', now) end
forget_gone({[n] = true})
save_streams()
save_meta()
refresh()
publish(meta.ver)
return tonumber(meta.ver)
