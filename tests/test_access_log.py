"""The access log: one line per request, when it ends (also when its client left), with what the proxy did.

A real proxy in front of the official SDK's server; the lines are the log records of ``mcpresume.access``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
import pytest

from mcpresume.daemon.cli import _JsonFormatter
from mcpresume.process.logs import log_id
from tests.support.poll import until
from tests.support.proxy import ScriptedClient, collect, running_proxy

ACCESS = "mcpresume.access"


def _lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == ACCESS]


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {name: getattr(record, name, None) for name in ("method", "path", "status", "action", "reason")}


async def test_a_session_logs_one_line_per_request_with_what_the_proxy_did(
    example_upstream: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, ACCESS)
    async with running_proxy(example_upstream) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()  # POST initialize, POST notifications/initialized
        _, body = client.tool_call("count_slowly", {"n": 2, "delay": 0.01})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            events = await collect(response)
        first = next(e for e in events if e.data)
        assert first.id is not None
        cursor = {"Last-Event-ID": first.id.decode(), "Accept": "text/event-stream"}
        async with http.get(client.url, headers=client.headers(**cursor)) as response:
            assert response.status == 200
            reattached_body = await response.read()
        gone = client.headers(**{"Mcp-Session-Id": "gone"})
        async with http.post(client.url, data=body, headers=gone) as response:
            assert response.status == 404
            refused_body = await response.read()
        async with http.get(proxy.url.replace("/mcp", "/.well-known/nothing")) as response:
            relayed_body = await response.read()
        await until(lambda: len(_lines(caplog)) == 6, what="six access lines")
    lines = _lines(caplog)
    assert [_fields(r) for r in lines] == [
        {"method": "POST", "path": "/mcp", "status": 200, "action": "forwarded", "reason": None},
        {"method": "POST", "path": "/mcp", "status": 202, "action": "forwarded", "reason": None},
        {"method": "POST", "path": "/mcp", "status": 200, "action": "forwarded", "reason": None},
        {"method": "GET", "path": "/mcp", "status": 200, "action": "reattached", "reason": None},
        {"method": "POST", "path": "/mcp", "status": 404, "action": "refused", "reason": "unknown_session"},
        {"method": "GET", "path": "/.well-known/nothing", "status": 404, "action": "relayed", "reason": None},
    ]
    initialize, initialized, call, reattach, refused, relayed = lines
    session = log_id(client.session_id)
    # The session by its hash (the answer that began it names it), never the id itself.
    assert [r.session for r in lines[:4]] == [session] * 4  # type: ignore[attr-defined]
    assert refused.session == log_id("gone")  # type: ignore[attr-defined]
    assert relayed.session is None  # type: ignore[attr-defined]
    assert all(client.session_id not in r.getMessage() for r in lines)
    assert [r.rpc for r in lines] == [  # type: ignore[attr-defined]
        "initialize",
        "notifications/initialized",
        "tools/call",
        None,
        "tools/call",
        None,
    ]
    assert call.bytes_in == len(body) and reattach.bytes_in == 0  # type: ignore[attr-defined]
    assert call.bytes_out > 0 and initialized.bytes_out == 0  # type: ignore[attr-defined]  # a 202
    # bytes_out: the body, whether the answer was whole (the proxy's own) or streamed (a view, a relay).
    assert refused.bytes_out == len(refused_body)  # type: ignore[attr-defined]
    # (a chunked body's end, 0 CRLF CRLF, is counted too)
    assert len(reattached_body) <= reattach.bytes_out <= len(reattached_body) + 5  # type: ignore[attr-defined]
    assert relayed.bytes_out == len(relayed_body)  # type: ignore[attr-defined]
    for record in lines:
        assert record.client == "127.0.0.1"  # type: ignore[attr-defined]
        assert record.duration_ms >= 0  # type: ignore[attr-defined]
    # The text line: client, "method path", status, action, the fields present, the duration.
    text = refused.getMessage()
    assert text.startswith('127.0.0.1 "POST /mcp" 404 refused reason=unknown_session ')
    assert f"session={log_id('gone')} rpc=tools/call bytes_in={len(body)}" in text
    assert text.endswith("ms")
    assert initialize.getMessage().startswith('127.0.0.1 "POST /mcp" 200 forwarded session=')


async def test_a_client_that_leaves_a_stream_gets_its_line_when_it_leaves(
    example_upstream: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The standalone GET's handler is cancelled when its client leaves: its line is written then, once,
    with the status it was answered (the head went out: 200)."""
    caplog.set_level(logging.INFO, ACCESS)
    async with running_proxy(example_upstream) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        response = await http.get(client.url, headers=client.headers(Accept="text/event-stream"))
        assert response.status == 200
        await until(lambda: proxy.ctx.local.attached_sessions() != [], what="the view is open")
        assert len(_lines(caplog)) == 2  # the stream is open: no line yet
        response.close()  # the client leaves
        await until(lambda: len(_lines(caplog)) == 3, what="the stream's line")
        standalone = _lines(caplog)[2]
        assert _fields(standalone) == {
            "method": "GET",
            "path": "/mcp",
            "status": 200,
            "action": "forwarded",
            "reason": None,
        }
        assert standalone.session == log_id(client.session_id)  # type: ignore[attr-defined]
        assert standalone.bytes_out > 0  # type: ignore[attr-defined]  # its head at least
    assert len(_lines(caplog)) == 3


async def test_off_writes_no_line(example_upstream: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, ACCESS)
    async with running_proxy(example_upstream, access_log=False) as proxy, aiohttp.ClientSession() as http:
        await ScriptedClient(http, proxy.url).initialize()
        assert await proxy.ctx.store.stats()  # the requests are done: their lines would have been written
    assert _lines(caplog) == []


async def test_json_lines_carry_the_fields_as_fields(
    example_upstream: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, ACCESS)
    async with running_proxy(example_upstream) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
    record = _lines(caplog)[0]
    line = json.loads(_JsonFormatter().format(record))
    assert line["logger"] == ACCESS and line["level"] == "info"
    assert line["status"] == 200 and line["action"] == "forwarded" and line["rpc"] == "initialize"
    assert line["session"] == log_id(client.session_id) and line["method"] == "POST"
    assert isinstance(line["bytes_out"], int) and isinstance(line["duration_ms"], float)
    assert line["msg"] == record.getMessage()
    # Any other line logged with extra= fields carries them too; a plain line has none.
    other = logging.LogRecord("mcpresume", logging.INFO, __file__, 1, "plain %s", ("line",), None)
    assert set(json.loads(_JsonFormatter().format(other))) == {"ts", "level", "logger", "msg"}
    other.__dict__.update({"session": "abc", "count": 3})
    assert json.loads(_JsonFormatter().format(other))["count"] == 3


async def test_a_request_routed_to_the_owner_replica_says_hopped_and_where(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Several replicas: b forwards a call of a's session to a (its line: hopped, and a's URL); a serves it
    (its own line: forwarded)."""
    from mcpresume.core.window import WindowLimits
    from mcpresume.store.memory import MemoryStore
    from tests.support.pods import pods

    caplog.set_level(logging.INFO, ACCESS)
    store = MemoryStore(WindowLimits(256, 1 << 20, 300.0), session_ttl=300.0, max_sessions=100, retry_ms=100)
    async with pods(store, 2) as (a, b), aiohttp.ClientSession() as http:
        client = ScriptedClient(http, a.url)
        await client.initialize()
        _, body = client.tool_call("add", {"a": 1, "b": 2})
        caplog.clear()
        async with http.post(b.url, data=body, headers=client.headers()) as response:
            assert response.status == 200
            await response.read()
        await until(lambda: len(_lines(caplog)) == 2, what="a line on each replica")
    lines = {r.action: r for r in _lines(caplog)}  # type: ignore[attr-defined]
    assert set(lines) == {"forwarded", "hopped"}
    served, hopped = lines["forwarded"], lines["hopped"]
    assert hopped.hop == a.url and served.hop is None  # type: ignore[attr-defined]
    assert served.session == hopped.session == log_id(client.session_id)  # type: ignore[attr-defined]
    assert f"hop={a.url}" in hopped.getMessage()


async def test_a_second_standalone_get_joins_the_first_ones_stream(
    example_upstream: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, ACCESS)
    async with running_proxy(example_upstream) as proxy, aiohttp.ClientSession() as http:
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        headers = client.headers(Accept="text/event-stream")
        first = await http.get(client.url, headers=headers)
        await until(lambda: proxy.ctx.local.attached(client.session_id) == 1, what="the first GET's view")
        second = await http.get(client.url, headers=headers)
        await until(lambda: proxy.ctx.local.attached(client.session_id) == 2, what="the second GET's view")
        assert first.status == second.status == 200
        second.close()
        await until(lambda: len(_lines(caplog)) == 3, what="the second GET's line")
        first.close()
        await until(lambda: len(_lines(caplog)) == 4, what="the first GET's line")
    joined, opened = _lines(caplog)[2:]
    assert (joined.action, opened.action) == ("joined", "forwarded")  # type: ignore[attr-defined]
