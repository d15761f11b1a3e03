-- touch (ARGV: now): client activity.
if redis.call('EXISTS', META) == 0 then return 0 end
redis.call('HSET', META, 'la', ARGV[A])
refresh()
return 1
