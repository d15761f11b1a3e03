"""The session inspector on a real proxy's admin port (memory and Redis stores), and ``mcpresume sessions``
reading it as a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import aiohttp
import pytest

from mcpresume.process.logs import log_id
from tests.support.pods import free_port
from tests.support.poll import until
from tests.support.proxy import ScriptedClient, collect, running_proxy

TOKEN = "s3cret-inspector-token"


async def _get(http: aiohttp.ClientSession, url: str, token: str | None = TOKEN) -> tuple[int, Any]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with http.get(url, headers=headers) as response:
        return response.status, await response.json() if response.content_type == "application/json" else None


async def test_off_unless_a_token_is_set(example_upstream: str) -> None:
    async with (
        running_proxy(example_upstream, metrics_port=free_port()) as proxy,
        aiohttp.ClientSession() as http,
    ):
        status, _ = await _get(http, f"{proxy.admin_url}/sessions")
        assert status == 404


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_the_inspector_shows_a_sessions_shape_and_nothing_of_its_content(
    example_upstream: str, backend: str, request: pytest.FixtureRequest
) -> None:
    settings: dict[str, Any] = {"metrics_port": free_port(), "inspect_token": TOKEN}
    if backend == "redis":
        settings |= {"store": request.getfixturevalue("redis_db"), "advertise_url": "http://127.0.0.1:1/mcp"}
        settings["replica_id"] = "pod-a"
    async with running_proxy(example_upstream, **settings) as proxy, aiohttp.ClientSession() as http:
        admin = proxy.admin_url
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        _, body = client.tool_call("count_slowly", {"n": 2, "delay": 0.01})
        async with http.post(client.url, data=body, headers=client.headers()) as response:
            events = await collect(response)
        standalone = await http.get(client.url, headers=client.headers(Accept="text/event-stream"))
        try:
            await until(lambda: proxy.ctx.local.attached(client.session_id) == 1, what="the GET's view")
            # Without the token, or with another: 401, nothing said.
            for token in (None, "wrong"):
                status, answer = await _get(http, f"{admin}/sessions", token)
                assert status == 401 and "sessions" not in answer
            status, page = await _get(http, f"{admin}/sessions")
            assert status == 200
            hashed = log_id(client.session_id)
            assert page["count"] == 1 and [s["session"] for s in page["sessions"]] == [hashed]
            brief = page["sessions"][0]
            # The initialize's stream, the call's, the standalone GET's.
            assert (brief["streams"], brief["live_streams"], brief["views_here"]) == (3, 1, 1)
            assert brief["owner"] == ("pod-a" if backend == "redis" else "")
            # One session, by its hash (the logs') and by its id: the same answer.
            status, by_hash = await _get(http, f"{admin}/sessions/{hashed}")
            assert status == 200
            assert await _get(http, f"{admin}/sessions/{client.session_id}") == (200, by_hash)
        finally:
            standalone.close()
    assert by_hash["session"] == hashed and by_hash["views_here"] == 1 and not by_hash["retired"]
    epoch = by_hash["epoch"]
    initialize, call, get = by_hash["streams"]
    assert [(s["origin"], s["phase"]) for s in (initialize, call, get)] == [
        ("post", "ended"),
        ("post", "ended"),
        ("get", "live"),
    ]
    assert call["last_seq"] - call["first_seq"] == 3  # its priming event, two progress events, the result
    assert call["delivered"] == call["last_seq"]  # its client read it all
    window = by_hash["window"]
    assert window["events"] == 7  # the initialize's 2, the call's 4, the GET's priming event
    assert window["oldest"] == f"{epoch}-{initialize['number']}-{initialize['first_seq']}"
    assert window["newest"] == f"{epoch}-{get['number']}-{get['first_seq']}"
    assert [e.id.decode() for e in events if e.id][-1] == f"{epoch}-{call['number']}-{call['last_seq']}"
    # the call's id (an initialize's id is no request of the session: not claimed, tests/test_request_ids.py)
    assert by_hash["claims"] == {"in_flight": 0, "answered": 0, "on_streams": 1}
    # No session id, no payload, no credential: the shape only.
    text = json.dumps(by_hash) + json.dumps(page)
    assert client.session_id not in text and "counted" not in text and "progress" not in text


async def test_an_unknown_session_is_404(example_upstream: str) -> None:
    async with (
        running_proxy(example_upstream, metrics_port=free_port(), inspect_token=TOKEN) as proxy,
        aiohttp.ClientSession() as http,
    ):
        assert (await _get(http, f"{proxy.admin_url}/sessions/0123456789"))[0] == 404
        assert (await _get(http, f"{proxy.admin_url}/sessions/no-such-session"))[0] == 404
        assert (await _get(http, f"{proxy.admin_url}/sessions?limit=x"))[0] == 400


async def _cli(*args: str, token: str = TOKEN) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCPRESUME_")}
    env["MCPRESUME_INSPECT_TOKEN"] = token
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "mcpresume",
        "sessions",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_mcpresume_sessions_reads_the_inspector(example_upstream: str) -> None:
    async with (
        running_proxy(example_upstream, metrics_port=free_port(), inspect_token=TOKEN) as proxy,
        aiohttp.ClientSession() as http,
    ):
        client = ScriptedClient(http, proxy.url)
        await client.initialize()
        admin = ("--admin-url", str(proxy.admin_url))
        code, out, err = await _cli(*admin)
        assert (code, err) == (0, "")
        lines = out.splitlines()
        assert lines[0] == "1-1 of 1 sessions"
        assert lines[1].split() == ["SESSION", "OWNER", "STREAMS", "LIVE", "EVENTS", "BYTES", "VIEWS", "IDLE"]
        assert lines[2].split()[:2] == [log_id(client.session_id), "-"]
        code, out, err = await _cli(log_id(client.session_id), *admin)
        assert code == 0 and json.loads(out)["session"] == log_id(client.session_id)
        code, out, err = await _cli("0123456789", *admin)
        assert code == 1 and out == "" and "no session 0123456789" in err
        code, out, err = await _cli(*admin, token="wrong")
        assert code == 2 and "Authorization: Bearer" in err
    code, out, err = await _cli(*admin)  # the proxy stopped
    assert code == 2 and err.startswith(f"mcpresume: cannot read the inspector at {proxy.admin_url}")
