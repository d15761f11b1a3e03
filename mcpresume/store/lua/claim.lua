-- claim (ARGV: epoch or '', most live streams or '', now or '' (a new claim is client activity then, as
-- touch), then per request id: its key, its request's digest (hex, '' when not known)): {outcome, stream} or
-- false.
-- Twin: mcpresume/core/session.py SessionState.claim
if not load_meta() or not epoch_ok(ARGV[A]) then return false end
if meta.rt == '1' then return false end  -- retired: new requests find the session unknown
local limit = ARGV[A + 1]
local now = ARGV[A + 2]
local keys, digests = {}, {}
for i = A + 3, #ARGV, 2 do keys[#keys + 1] = ARGV[i]; digests[#digests + 1] = ARGV[i + 1] end
local holders = {}
local any_resent, all_resent = false, true
for i, key in ipairs(keys) do
  local holder, digest = claim_of(redis.call('HGET', RQ, key))
  holders[i] = holder or false
  if holder and same_request(digest, digests[i]) then any_resent = true else all_resent = false end
end
if any_resent then  -- a re-send: never forwarded again
  if not all_resent then return {'conflict', ''} end
  for i = 2, #keys do if holders[i] ~= holders[1] then return {'conflict', ''} end end
  local holder = holders[1]
  if holder == 'p' then return {'in_flight', ''} end
  if holder == 'a' then return {'answered', ''} end
  if holder == 'u' then return {'unknown', ''} end
  if holder == 'c' then return {'cancelled', ''} end
  local s = stream(tonumber(holder))
  if s and (s.e or 0) == 0 then return {'attach', holder} end
  return {'gone', holder}
end
-- Each id is new, or another request's: free again once that request is over.
for i = 1, #keys do
  if holders[i] and not request_over(holders[i]) then return {'in_use', ''} end
end
if limit ~= '' and num('lp') + num('inf') >= tonumber(limit) then return {'limited', ''} end
for i, key in ipairs(keys) do remember_request(key, 'p', digests[i]) end
if now ~= '' and num('la') < tonumber(now) then set('la', now) end  -- as touch
save_meta()
refresh()
return {'new', ''}
