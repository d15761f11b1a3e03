-- release / settle / abandon (ARGV: epoch or '', 'release', 'settle' or 'abandon', request keys...).
-- Twin: mcpresume/core/session.py SessionState.release, SessionState.settle, SessionState.abandon
if not load_meta() or not epoch_ok(ARGV[A]) then return 0 end
local mode = ARGV[A + 1]
for i = A + 2, #ARGV do
  local key = ARGV[i]
  if claim_of(redis.call('HGET', RQ, key)) == 'p' then
    if mode == 'settle' then remember_request(key, 'a')
    elseif mode == 'abandon' then remember_request(key, 'u')
    else forget_request(key) end
  end
end
save_meta()
return 1
