"""The admin side and the start-up of a replica whose Redis does not answer, with a real ``redis-server``.

* A scrape during an outage answers 200 with every metric (the store's gauges keep their last values) and
  counts the failure in ``mcpresume_store_errors_total{op="stats"}``: Prometheus must not mark the instance
  down exactly when that counter matters.
* A replica started before its Redis (a sidecar whose Redis comes up late) serves, not ready: ``/readyz``
  503, requests on the MCP endpoint 503 ``store_unavailable``, one log line per retry interval; once Redis
  answers it registers its lease, adopts the streams its previous process left, and is ready. The command
  line runs as a real process here: its log is what an operator reads.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from mcpresume.core.cursor import encode_cursor
from mcpresume.core.session import NewEvent, PumpRecord, StreamOrigin
from mcpresume.core.sse import frame_body
from mcpresume.core.window import EventKind, WindowLimits
from mcpresume.daemon.app import STORE_RETRY_INTERVAL
from mcpresume.store import SessionStore
from tests.conftest import ServeApp
from tests.support import INITIALIZE_BODY, MCP_HEADERS
from tests.support import playbook as pb
from tests.support.poll import until
from tests.support.proxy import ScriptedClient, collect, error_of, running_proxy
from tests.support.redis import MakeRedisStore, RedisProcess, free_port
from tests.support.scripted import SESSION, ScriptedUpstream
from tests.test_redis_proxy import on_redis


async def _scrape(http: aiohttp.ClientSession, admin_url: str) -> dict[str, float]:
    """Every sample of a ``/metrics`` scrape (which must answer 200), by name and labels."""
    async with http.get(f"{admin_url}/metrics") as response:
        assert response.status == 200, await response.text()
        text = await response.text()
    return {
        sample.name + orjson.dumps(sample.labels, option=orjson.OPT_SORT_KEYS).decode(): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_a_scrape_during_a_store_outage_answers_200_with_every_metric(
    example_upstream: str, own_redis: RedisProcess
) -> None:
    async with (
        running_proxy(example_upstream, **on_redis(own_redis.url, metrics_port=free_port())) as proxy,
        aiohttp.ClientSession() as http,
    ):
        assert proxy.admin_url is not None
        await ScriptedClient(http, proxy.url).initialize()
        before = await _scrape(http, proxy.admin_url)
        assert before["mcpresume_sessions{}"] == 1.0
        own_redis.stop()
        during = await _scrape(http, proxy.admin_url)
        errors = 'mcpresume_store_errors_total{"op":"stats"}'
        assert during[errors] >= before.get(errors, 0.0) + 1  # the failed read of the store, counted
        # Every series is still there; those read from the store keep their last values.
        assert set(before) <= set(during)
        for gauge in ("mcpresume_sessions{}", "mcpresume_window_events{}", "mcpresume_window_bytes{}"):
            assert during[gauge] == before[gauge]
        own_redis.restart()  # empty: the gauges follow the store again once it answers
        await until(
            lambda: _sessions_gauge(http, proxy.admin_url or "", 0.0), what="the gauge read from Redis again"
        )


async def _sessions_gauge(http: aiohttp.ClientSession, admin_url: str, wanted: float) -> bool:
    return (await _scrape(http, admin_url))["mcpresume_sessions{}"] == wanted


# -- a replica started before its Redis ---------------------------------------------------------------------


def _lines(log: Path) -> list[str]:
    return log.read_text(errors="replace").splitlines() if log.exists() else []


async def test_a_replica_started_before_its_redis_serves_not_ready_then_becomes_ready(
    serve: ServeApp, tmp_path: Path
) -> None:
    upstream = await serve(pb.Playbook().app())
    redis = RedisProcess(tmp_path)
    redis.port = free_port()  # where it will listen, once started (late)
    port, admin_port = free_port(), free_port()
    admin = f"http://127.0.0.1:{admin_port}"
    log = tmp_path / "stderr.log"
    argv = [sys.executable, "-m", "mcpresume", "serve", "--upstream", upstream, "--store", redis.url]
    argv += ["--advertise-url", f"http://127.0.0.1:{port}/mcp", "--replica-id", "late-redis"]
    argv += ["--port", str(port), "--metrics-port", str(admin_port)]
    env = {name: value for name, value in os.environ.items() if not name.startswith("MCPRESUME_")}
    started = time.monotonic()
    with log.open("wb") as stderr:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=stderr, stderr=stderr, env=env
        )
    try:
        async with aiohttp.ClientSession() as http:

            async def readyz() -> int | None:
                if process.returncode is not None:
                    raise AssertionError(f"exited {process.returncode}:\n" + "\n".join(_lines(log)))
                try:
                    async with http.get(f"{admin}/readyz") as response:
                        return response.status
                except aiohttp.ClientConnectionError:
                    return None  # not listening yet

            async def listening() -> bool:
                return await readyz() is not None

            async def ready() -> bool:
                return await readyz() == 200

            await until(listening, timeout=60, what="the admin listener", every=0.05)
            assert await readyz() == 503
            async with http.post(
                f"http://127.0.0.1:{port}/mcp", data=INITIALIZE_BODY, headers=MCP_HEADERS
            ) as answer:
                assert answer.status == 503
                assert (await error_of(answer))["data"]["reason"] == "store_unavailable"
            # Redis comes up a few retries late.
            await until(
                lambda: sum("not ready:" in line for line in _lines(log)) >= 3,
                timeout=60,
                what="three retries",
                every=0.05,
            )
            redis.restart()  # its first start, on the port the replica was told
            await until(ready, timeout=60, what="/readyz 200", every=0.05)
            ready = time.monotonic()
            async with http.post(
                f"http://127.0.0.1:{port}/mcp", data=INITIALIZE_BODY, headers=MCP_HEADERS
            ) as answer:
                assert answer.status == 200
                assert answer.headers["Mcp-Session-Id"] == pb.SESSION
            metrics = await _scrape(http, admin)
            assert metrics["mcpresume_replicas{}"] == 1.0  # its lease registered once Redis answered
            assert metrics["mcpresume_sessions{}"] == 1.0
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        redis.stop()
    lines = _lines(log)
    retries = [line for line in lines if "not ready: the session store did not answer" in line]
    # One line per retry interval: no more attempts than the time it took allows.
    assert 3 <= len(retries) <= (ready - started) / STORE_RETRY_INTERVAL + 1, lines
    known = (
        "not ready: the session store did not answer",
        f"mcpresume {_version()}: ",
        "admin: ",
        # the request answered before the store was asked: the replica is not ready
        "POST /mcp -> 503 store_unavailable: the session store has not answered since this replica started",
        "the session store answers: ready",
        "session ",  # ... begins
        "draining",
        "INFO mcpresume.access: ",  # a line per request
        "INFO mcpresume.bridge: the upstream's era: ",  # the era probe at start answered
        "INFO mcpresume: stopped",  # the last line
    )
    assert [line for line in lines if not any(k in line for k in known)] == []  # no traceback, nothing else
    assert sum("the session store answers: ready" in line for line in lines) == 1


def _version() -> str:
    from mcpresume import __version__

    return __version__


REQUEST = 7


async def _left_by_a_dead_process(store: SessionStore, owner: str, total: int, sent: int) -> bytes:
    """A session of ``owner`` with a POST stream whose pump appended ``sent`` progress events, then died;
    the cursor of the last one (what its client holds)."""
    epoch = await store.create_session(SESSION, now=time.time(), owner=owner)
    record = PumpRecord((REQUEST,), "/mcp", (("Mcp-Session-Id", SESSION),))
    opened = await store.open_stream(SESSION, StreamOrigin.POST, [f"n:{REQUEST}"], time.time(), pump=record)
    assert opened is not None
    events = []
    for k in range(sent):
        params = {"progressToken": REQUEST, "progress": k + 1, "total": total}
        body = {"jsonrpc": "2.0", "method": "notifications/progress", "params": params}
        events.append(NewEvent(frame_body(orjson.dumps(body)), EventKind.MESSAGE))
    await store.append(SESSION, opened.number, events, time.time(), upstream_cursor=f"{REQUEST}-{sent - 1}")
    return encode_cursor(epoch, opened.number, opened.priming_seq + sent)


async def test_streams_left_by_the_previous_process_are_adopted_once_the_store_answers(
    serve: ServeApp, own_redis: RedisProcess, redis_stores: MakeRedisStore
) -> None:
    """Redis does not answer (paused) when the replica starts: it serves, not ready, and adopts nothing; once
    Redis answers, the stream its previous process was pumping is resumed upstream, once."""
    upstream = ScriptedUpstream(total=10)
    url = await serve(upstream.app())
    store = await redis_stores(own_redis.url, WindowLimits(256, 1 << 20, 300.0))
    cursor = await _left_by_a_dead_process(store, "pod-a", total=10, sent=3)
    headers = {"Mcp-Session-Id": SESSION, "Last-Event-ID": cursor.decode(), "Accept": "text/event-stream"}
    own_redis.pause()
    try:
        async with (
            running_proxy(
                url, **on_redis(own_redis.url, replica_id="pod-a", metrics_port=free_port())
            ) as proxy,
            aiohttp.ClientSession() as http,
        ):
            assert proxy.admin_url is not None
            async with http.get(f"{proxy.admin_url}/readyz") as response:
                assert response.status == 503
            async with http.get(proxy.url, headers=headers) as response:
                assert response.status == 503
                assert (await error_of(response))["data"]["reason"] == "store_unavailable"
            assert upstream.gets == [] and len(proxy.ctx.pumps) == 0  # nothing adopted while it is down
            own_redis.resume()

            async def ready() -> bool:
                async with http.get(f"{proxy.admin_url}/readyz") as response:
                    return response.status == 200

            await until(ready, timeout=60, what="/readyz 200", every=0.05)
            async with http.get(proxy.url, headers=headers) as response, asyncio.timeout(30):
                assert response.status == 200
                messages = [orjson.loads(e.data) for e in await collect(response) if e.data]
    finally:
        own_redis.resume()
    assert upstream.gets == [f"{REQUEST}-2"]  # resumed from the last upstream id in the store, once
    progress = [m["params"]["progress"] for m in messages if m.get("method") == "notifications/progress"]
    assert progress == list(range(4, 11))
    assert [m["id"] for m in messages if "result" in m] == [REQUEST]
