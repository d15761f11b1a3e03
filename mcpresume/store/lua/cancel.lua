-- cancel_requests (ARGV: stream, request keys...): 1, or 0 when the session is gone.
-- Twin: mcpresume/core/session.py SessionState.cancel_requests
if not load_meta() then return 0 end
local n = ARGV[A]
for i = A + 1, #ARGV do
  local key = ARGV[i]
  if claim_of(redis.call('HGET', RQ, key)) == n then remember_request(key, 'c') end  -- its digest kept
end
save_meta()
return 1
