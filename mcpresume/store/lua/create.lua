-- create_session: a fresh incarnation (ARGV: epoch, now, credential hex or '', owner).
-- Twin: mcpresume/store/memory.py MemoryStore.create_session
local epoch, now, cred, owner = ARGV[A], ARGV[A + 1], ARGV[A + 2], ARGV[A + 3]
local old = redis.call('HMGET', META, 'nst', 'ver')
local nst, ver = 1, 0
if old[1] then nst = tonumber(old[1]); ver = tonumber(old[2]) + 1 end
drop_all()
redis.call('HSET', META, 'sid', SID, 'epoch', epoch, 'nseq', 1, 'nst', nst, 'ver', ver, 'la', now,
  'cred', cred, 'pv', '', 'inf', 0, 'ne', 0, 'nb', 0, 'hc', 0, 'hb', 0, 'lp', 0, 'own', owner, 'fen', 0, 'rc', 0, 'gone', '[]', 'gs', '', 'sa', '')
refresh()
publish(ver)
return ver
