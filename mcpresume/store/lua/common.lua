-- Shared by every script of the Redis store (mcpresume/store/redis.py prepends it to each one, after the
-- store's settings as Lua constants: META_TTL and EV_TTL (ms), MAX_EVENTS, MAX_BYTES, WINDOW_TTL (s),
-- MAX_IDS, MAX_GONE). KEYS: the session's meta hash, events stream, stream-state hash, request-id hash,
-- request-id order zset, event-bodies hash (one hash tag: one slot). ARGV[1]: this process's token, ARGV[2]: the session id;
-- the op's own arguments start at ARGV[3].
local META, EV, ST, RQ, RO, BD = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local TOKEN, SID = ARGV[1], ARGV[2]
local A = 3
local CHANNEL = 'mcpresume:news'

local meta, dirty = nil, {}
-- The session's meta (nil: the session is unknown): every field, or (``fields``, 'epoch' first: the
-- append's few, out of twenty) those, and any other when first read.
local function load_meta(fields)
  if fields == nil then
    local raw = redis.call('HGETALL', META)
    if #raw == 0 then return nil end
    meta = {}
    for i = 1, #raw, 2 do meta[raw[i]] = raw[i + 1] end
    return meta
  end
  local values = redis.call('HMGET', META, unpack(fields))
  if not values[1] then return nil end
  local absent = {}
  meta = setmetatable({}, {__index = function(t, field)
    if absent[field] then return nil end
    local value = redis.call('HGET', META, field)
    if value then rawset(t, field, value) else absent[field] = true; value = nil end
    return value
  end})
  for i = 1, #fields do
    if values[i] then meta[fields[i]] = values[i] else absent[fields[i]] = true end
  end
  return meta
end
local function num(field) return tonumber(meta[field]) or 0 end
local function set(field, value) meta[field] = value; dirty[field] = value end
local function save_meta()
  local args = {}
  for k, v in pairs(dirty) do args[#args + 1] = k; args[#args + 1] = v end
  if #args > 0 then redis.call('HSET', META, unpack(args)) end
  dirty = {}
end

local streams, sdirty = {}, {}
local function stream(n)
  local s = streams[n]
  if s == nil then
    local raw = redis.call('HGET', ST, n)
    if not raw then streams[n] = false; return nil end
    s = cjson.decode(raw)
    if type(s.g) ~= 'table' then s.g = {} end
    if type(s.k) ~= 'table' then s.k = {} end
    streams[n] = s
  end
  if s == false then return nil end
  return s
end
local function mark(n) sdirty[n] = true end
local function save_streams()
  for n, _ in pairs(sdirty) do
    local s = streams[n]
    if s then
      redis.call('HSET', ST, n, cjson.encode(s))
    else
      redis.call('HDEL', ST, n)
    end
  end
  sdirty = {}
end

-- The keys' TTLs (a backstop: they outlive the logical limits by a minute and more). ``lazily`` (an append,
-- the hot path): only when the last refresh is 2 s old or more by Redis's own clock (six PEXPIREs are a
-- third of a small append's time); the meta's 'rx' says when, so call it before save_meta().
local clock = nil
local function redis_now()  -- Redis's own clock, in whole seconds (once per script)
  if clock == nil then clock = tonumber(redis.call('TIME')[1]) end
  return clock
end

local function refresh(lazily)
  if lazily then
    local t = redis_now()
    if t - num('rx') < 2 then return end
    set('rx', t)
  end
  for _, key in ipairs({META, ST, RQ, RO}) do redis.call('PEXPIRE', key, META_TTL) end
  redis.call('PEXPIRE', EV, EV_TTL)
  redis.call('PEXPIRE', BD, EV_TTL)
end

-- Who hears the session's news: the meta's 'ls', '<token> <deadline> ...' (Redis's clock, seconds), each
-- process that read the session or appended to it in the last LISTEN seconds (``listen``, by read, view,
-- open and append; written again only when under RELISTEN seconds are left). A change is published only
-- when another process listens: one replica alone, or the pumping replica's own views, cost Redis no
-- PUBLISH and the process no message of its own to drop. A waiting view reads again at least every 15 s
-- (its heartbeat), so its process stays listed while it waits; a session not loaded (create, delete) is
-- always published.
local LISTEN, RELISTEN = 60, 40
local function listen()
  local now, mine, kept = redis_now(), nil, {}
  for token, deadline in string.gmatch(meta.ls or '', '(%S+) (%d+)') do
    deadline = tonumber(deadline)
    if token == TOKEN then mine = deadline
    elseif deadline > now then kept[#kept + 1] = token .. ' ' .. deadline end
  end
  if mine and mine - now >= RELISTEN then return end
  kept[#kept + 1] = TOKEN .. ' ' .. (now + LISTEN)
  set('ls', table.concat(kept, ' '))
end
local function heard_elsewhere()
  if meta == nil then return true end
  local now = redis_now()
  for token, deadline in string.gmatch(meta.ls or '', '(%S+) (%d+)') do
    if token ~= TOKEN and tonumber(deadline) > now then return true end
  end
  return false
end

local function publish(version)
  if heard_elsewhere() then redis.call('PUBLISH', CHANNEL, TOKEN .. ' ' .. version .. ' ' .. SID) end
end

-- A delivery mark (delivered.lua, or carried by the session's next append: mcpresume/store/marks.py): the
-- last seq a client of stream n was sent; it only moves forward.
-- Twin: mcpresume/core/session.py SessionState.mark_delivered
local function mark_delivered(n, seq)
  local s = stream(n)
  if s and (s.d or 0) < seq then s.d = seq; mark(n) end
end

local function drop_all() redis.call('DEL', META, EV, ST, RQ, RO, BD) end

local function new_counts()
  return {count = {0, 0}, bytes = {0, 0}, ttl = {0, 0}, und = {0, 0}}
end
local function flat_counts(c)
  return {c.count[1], c.count[2], c.bytes[1], c.bytes[2], c.ttl[1], c.ttl[2], c.und[1], c.und[2]}
end

local function seq_of(id) return tonumber(string.match(id, '^(%d+)')) end

-- Events are kept as runs (segments): one entry per append, id '<seq of its first event>-0', two fields:
-- m, '<stream> <append time> <count> <bytes> <the field of BD that holds the bodies, concatenated>', and z,
-- each event's bytes (4 bytes little-endian each). Two fields, not one per value: a stream walks every
-- field of the entries XTRIM left deleted in its head node, and Lua takes in each as a string of its own
-- (an XRANGE and an XTRIM cost 2.1 and 2.8 us, where six fields cost 3.2 and 4.0). Entries of an earlier
-- version, one field each (s t c z k n), read the same. The bodies never pass through Lua (a 64 KiB string
-- costs a script about 90 us to take in or hand out, a plain command about 10): the client writes them
-- (HSET, in the same MULTI as the append) and reads them (HMGET). The oldest entry may be cut: meta hc/hb =
-- how many of its first events (bytes) are evicted already.
local function entry(raw)
  local f = raw[2]
  if f[1] == 'm' then
    local s, t, c, n, k = string.match(f[2], '^(%d+) (%S+) (%d+) (%d+) (%S+)$')
    return {id = raw[1], first = seq_of(raw[1]), s = tonumber(s), t = tonumber(t), c = tonumber(c),
      z = f[4], k = k, n = tonumber(n), ts = t}
  end
  return {id = raw[1], first = seq_of(raw[1]), s = tonumber(f[2]), t = tonumber(f[4]), c = tonumber(f[6]),
    z = f[8], k = f[10], n = tonumber(f[12]), ts = f[4]}
end
local function add_entry(seq, n, now, count, lengths, key, size)
  redis.call('XADD', EV, seq .. '-0', 'm', n .. ' ' .. now .. ' ' .. count .. ' ' .. size .. ' ' .. key, 'z', lengths)
end
local function sizes(e)
  if not e.sz then
    local t = {}
    for i = 1, e.c do t[i] = struct.unpack('<I4', e.z, 4 * i - 3) end
    e.sz = t
  end
  return e.sz
end

-- The events key expired (its TTL outlived every event's age) while the meta stayed: all evicted by age.
local function sync_expired(counts, touched)
  if num('ne') > 0 and redis.call('EXISTS', EV) == 0 then
    counts.ttl[1] = counts.ttl[1] + num('ne'); counts.ttl[2] = counts.ttl[2] + num('nb')
    for _, n in ipairs(redis.call('HKEYS', ST)) do
      local s = stream(tonumber(n))
      if s and s.l >= s.f then s.e = s.l; mark(tonumber(n)); touched[tonumber(n)] = true end
    end
    set('ne', 0); set('nb', 0); set('hc', 0); set('hb', 0)
    redis.call('DEL', BD)
    return true
  end
  return false
end

-- Evict oldest first until the window's limits hold (event by event where the twin cuts segments):
-- Twin: mcpresume/core/window.py Window._enforce
-- expired events first, then by count, then by bytes; the newest event never by count or bytes.
local function evict(now, counts, touched)
  local ne, nb = num('ne'), num('nb')
  if ne == 0 then return false end
  local deadline = now - WINDOW_TTL
  local hc, hb = num('hc'), num('hb')
  if ne <= MAX_EVENTS and nb <= MAX_BYTES then
    local first = redis.call('XRANGE', EV, '-', '+', 'COUNT', 1)[1]
    if first == nil or entry(first).t > deadline then return false end
  end
  local gone_through = nil  -- the first seq of the last entry wholly evicted
  local bodies = {}  -- the BD fields of the entries wholly evicted
  local any = false
  local from = '-'
  local stop = false
  local want = 2  -- fetched a few at a time, more as they go
  while not stop do
    local batch = redis.call('XRANGE', EV, from, '+', 'COUNT', want)
    for i = 1, #batch do
      local e = entry(batch[i])
      local st = stream(e.s)
      local k = hc + 1  -- the first event of the entry still retained
      local expired = e.t <= deadline
      local avail = e.c - hc
      if expired or ne - avail >= MAX_EVENTS then
        -- The usual case, in one step: all of it goes, by age or by count alone (and never the newest:
        -- MAX_EVENTS >= 1 events stay after it).
        local bytes = e.n - hb
        local tally = counts[expired and 'ttl' or 'count']
        tally[1] = tally[1] + avail; tally[2] = tally[2] + bytes
        local last = e.first + e.c - 1
        if st then
          local sent = math.max(0, math.min(avail, (st.d or 0) - (e.first + hc) + 1))
          if sent < avail then
            local lost = bytes
            if sent > 0 then
              local z = sizes(e)
              lost = 0
              for j = hc + sent + 1, e.c do lost = lost + z[j] end
            end
            counts.und[1] = counts.und[1] + avail - sent; counts.und[2] = counts.und[2] + lost
          end
          st.e = last
        end
        ne = ne - avail; nb = nb - bytes; k = e.c + 1
        any = true
      end
      local z = k <= e.c and sizes(e) or nil
      while k <= e.c do
        local reason
        if expired then reason = 'ttl'
        elseif ne <= 1 then break
        elseif ne > MAX_EVENTS then reason = 'count'
        elseif nb > MAX_BYTES then reason = 'bytes'
        else break end
        local seq, size = e.first + k - 1, z[k]
        local tally = counts[reason]
        tally[1] = tally[1] + 1; tally[2] = tally[2] + size
        if st then
          if seq > (st.d or 0) then counts.und[1] = counts.und[1] + 1; counts.und[2] = counts.und[2] + size end
          st.e = seq
        end
        ne = ne - 1; nb = nb - size; hb = hb + size; k = k + 1
        any = true
      end
      if st and k > hc + 1 then mark(e.s); touched[e.s] = true end
      if k > e.c then
        gone_through = e.first; hc = 0; hb = 0  -- wholly evicted: the next entry is the oldest
        bodies[#bodies + 1] = e.k
      else
        hc = k - 1
        stop = true
        break
      end
    end
    if stop or #batch < want then break end
    from = '(' .. batch[#batch][1]
    want = math.min(16, want * 2)
  end
  if not any then return false end
  if gone_through ~= nil then
    redis.call('XTRIM', EV, 'MINID', '=', (gone_through + 1) .. '-0')
    for i = 1, #bodies, 1000 do redis.call('HDEL', BD, unpack(bodies, i, math.min(i + 999, #bodies))) end
  end
  set('ne', ne); set('nb', nb); set('hc', hc); set('hb', hb)
  return true
end

local function gone_list()
  local raw = meta.gone
  if not raw or raw == '' then return {} end
  local t = cjson.decode(raw)
  if type(t) ~= 'table' then return {} end
  return t
end

-- A stream that ended and holds no event any more is forgotten: (number, last seq) of the last MAX_GONE of
-- them are kept (a view that sent one whole reads it complete), and the newest standalone one whole (a
-- re-attach at its very end opens a new one).
-- Twin: mcpresume/core/session.py SessionState._forget_gone_streams
local function forget_gone(candidates)
  local numbers = {}
  for n, _ in pairs(candidates) do numbers[#numbers + 1] = n end
  table.sort(numbers)
  local t = nil
  for _, n in ipairs(numbers) do
    local s = stream(n)
    if s and s.v == 0 and ((s.e or 0) >= s.l or s.l < s.f) then
      streams[n] = false; mark(n)
      if t == nil then t = gone_list() end
      t[#t + 1] = {n, s.l}
      while #t > MAX_GONE do table.remove(t, 1) end
      if s.o == 'get' then
        local before = meta.gs and meta.gs ~= '' and cjson.decode(meta.gs) or nil
        if before == nil or n > before[1] then set('gs', cjson.encode({n, s.f, s.l})) end
      end
      for _, member in ipairs(s.g) do
        local other = stream(member)
        if other then
          local kept = {}
          for _, m in ipairs(other.g) do if m ~= n then kept[#kept + 1] = m end end
          other.g = kept
          if s.l > (other.gl or 0) then other.gl = s.l end
          mark(member)
        end
      end
    end
  end
  if t ~= nil then set('gone', cjson.encode(t)) end
end

-- The last seq of a forgotten stream, if it is among the last MAX_GONE.
local function gone_last(n)
  local found = nil
  for _, entry in ipairs(gone_list()) do if entry[1] == n then found = entry[2] end end
  return found
end

-- The events key expired (every event older than the window's age limit): evicted, as reap would have, and
-- said (a read or view of the session finds it so).
local function settle_expired()
  local counts, touched = new_counts(), {}
  if sync_expired(counts, touched) then
    forget_gone(touched)
    set('ver', num('ver') + 1)
    save_streams()
    save_meta()
    publish(meta.ver)
  end
end

-- The session's live streams with a pump record (orphans.lua, takeover.lua), in the order they were opened:
-- {number, origin, pump record, upstream cursor, answered keys} each.
-- Twin: mcpresume/core/session.py SessionState.orphans
local function orphans()
  local found = {}
  local raw = redis.call('HGETALL', ST)
  for i = 1, #raw, 2 do
    local n = tonumber(raw[i])
    local s = stream(n)
    if s and s.v == 1 and s.pm and s.pm ~= '' then
      found[#found + 1] = {n, s.o, s.pm, s.u, s.a or {}}
    end
  end
  table.sort(found, function(x, y) return x[1] < y[1] end)
  return found
end

-- request ids: RQ maps a key to its claim, '<holder> <digest>': the holder 'p' (pending), 'a' (answered),
-- 'u' (sent, no answer: its outcome unknown), 'c' (cancelled by the client, its stream closed unanswered) or
-- a stream number; the digest of its request (hex), absent
-- when not known (then any request matches). RO orders them.
local function claim_of(raw)  -- the holder and the digest of a claim as RQ holds it (nil: none)
  if not raw then return nil, nil end
  local holder, digest = string.match(raw, '^(%S+) (%S+)$')
  if holder then return holder, digest end
  return raw, ''
end

-- Twin: mcpresume/core/session.py same_request
local function same_request(digest, other)
  return digest == '' or other == '' or digest == other
end

-- Twin: mcpresume/core/session.py SessionState._over
local function request_over(holder)
  if holder == 'a' or holder == 'c' then return true end
  if holder == 'p' or holder == 'u' then return false end
  local s = stream(tonumber(holder))
  return not s or s.v == 0
end

-- Twin: mcpresume/core/session.py SessionState._forget_request
local function forget_request(key)
  local holder = claim_of(redis.call('HGET', RQ, key))
  if not holder then return end
  redis.call('HDEL', RQ, key)
  redis.call('ZREM', RO, key)
  if holder == 'p' then set('inf', num('inf') - 1) end
end

-- ``digest`` nil: the one the key's claim has (if any) is kept.
-- Twin: mcpresume/core/session.py SessionState._remember_request
local function remember_request(key, holder, digest)
  local max_ids = MAX_IDS
  local before = redis.call('HGET', RQ, key)
  if before then
    if digest == nil then local _, kept = claim_of(before); digest = kept end
    forget_request(key)
  end
  local value = tostring(holder)
  if digest and digest ~= '' then value = value .. ' ' .. digest end
  redis.call('HSET', RQ, key, value)
  local order = num('rc') + 1
  set('rc', order)
  redis.call('ZADD', RO, order, key)
  if holder == 'p' then set('inf', num('inf') + 1) end
  while redis.call('ZCARD', RO) > max_ids do
    forget_request(redis.call('ZRANGE', RO, 0, 0)[1])
  end
end

local function epoch_ok(epoch)
  return epoch == '' or meta.epoch == epoch
end
-- Fencing (ARCHITECTURE.md, invariant "one writer per session"): the meta's 'fen' grows with every change
-- of owner (takeover.lua, orphans.lua); a pump's writes carry the fence it was given, and a write whose
-- fence is not the session's is refused ('' : an unfenced writer, a session without owners).
-- Twin: mcpresume/store/memory.py MemoryStore._fenced
local function fence_ok(fence)
  return fence == nil or fence == '' or num('fen') == tonumber(fence)
end

-- Stream n ends: no more appends (end.lua; append.lua with the stream's last events). False: nothing
-- changed (no such stream, or ended already). The caller saves and publishes.
-- Twin: mcpresume/core/session.py SessionState.end_stream
local function end_stream(n, now)
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
  return true
end
