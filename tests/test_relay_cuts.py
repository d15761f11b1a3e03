"""The official SDK client, through a relay that really cuts connections at random byte offsets, through the
proxy, to the official SDK server WITHOUT an event store (it cannot resume anything itself).

Every tools/call completes, and at the transport (the bytes the client actually received) no progress
notification or result is delivered twice, and none is lost.

The SDK client (mcp 2.3.0) treats an abrupt cut as an error and gives up after two failed reconnects in a
row (MAX_RECONNECTION_ATTEMPTS = 2), whatever the server does. Worse, when a re-attach stream is itself cut,
it reconnects with its *previous* Last-Event-ID, not the last id it processed (``_handle_reconnection``'s
exception path passes the stale ``last_event_id``), so it asks again for events it already applied: a
client bug no server can see. So each call here gets one cut, at a random offset of its POST stream.
Invariants #1, #2 and #8, at the transport: no event twice, none missing, every result once.
"""

from __future__ import annotations

from collections import Counter

import orjson
import pytest

from tests.support.metrics import sample
from tests.support.proxy import running_proxy
from tests.support.relay import CuttingRelay
from tests.support.sdk import count_slowly, sdk_session

CALLS = 5
N = 6


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_sdk_calls_survive_random_cuts_exactly_once(example_upstream: str, seed: int) -> None:
    # retry_ms=50: the SDK honours the proxy's retry hint, so reconnects are quick.
    async with running_proxy(example_upstream, retry_ms=50) as proxy:
        relay = CuttingRelay("127.0.0.1", proxy.port, seed=seed, record=True)
        async with relay, sdk_session(relay.url_for("/mcp"), read_timeout_seconds=30) as session:
            calls = []
            for _ in range(CALLS):
                relay.set_policy(cut_after=(250, 900), sse_only=True, max_cuts=relay.policy_cuts + 1)
                calls.append(await count_slowly(session, n=N, delay=0.02))
        reattached = sample(proxy.ctx.metrics, "mcpresume_resumptions_total", outcome="reattach")

    for call in calls:
        assert call.text == f"counted to {N}"
        assert [p for p, _, _ in call.progress] == list(range(1, N + 1))
    assert relay.policy_cuts > 0, "the relay must really have cut streams"
    assert reattached > 0, "the client must really have re-attached"

    # Count at the transport. A cut response's events count up to the one the client resumed after (the
    # Last-Event-ID of its re-attach): bytes past that point were on the wire but never reached the client's
    # application (its HTTP stack drops a cut read), so the proxy rightly sends them again.
    resumed_from = {r.header("last-event-id") for r in relay.requests() if r.method == "GET"} - {None}
    seen: Counter[tuple[object, ...]] = Counter()
    for response in relay.responses(sse=True):
        events = response.sse_events()
        if response.cut:
            acked = [i for i, e in enumerate(events) if e.id in resumed_from]
            events = events[: acked[-1] + 1] if acked else []
        for event in events:
            if not event.data:
                continue
            message = orjson.loads(event.data)
            if message.get("method") == "notifications/progress":
                params = message["params"]
                seen[("progress", params["progressToken"], params["progress"])] += 1
            elif "result" in message and "content" in message["result"]:
                seen[("result", message["id"])] += 1
    duplicates = {key: count for key, count in seen.items() if count > 1}
    assert not duplicates
    assert sum(1 for key in seen if key[0] == "result") == CALLS
    assert sum(1 for key in seen if key[0] == "progress") == CALLS * N
