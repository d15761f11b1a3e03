"""A hostile or broken upstream's gzip bomb (about 1 MiB on the wire, 1 GiB inflated) on every path whose
answer the proxy reads decompressed: a POST's SSE answer (the pooled client, aiohttp's decoder), a POST's JSON
answer, and the standalone GET (a held GET, ``streams/heldget.py``'s decoder). The proxy runs in this process,
so its peak RSS is this process's: reset (``/proc/self/clear_refs``) before the bomb, read after (``VmHWM``).
Each client gets the bounded error, and the peak stays far below what the bomb expands to.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import aiohttp
import orjson
import pytest

from mcpresume.process.metrics import Metrics
from tests.support import INITIALIZE
from tests.support import playbook as pb
from tests.support.metrics import sample
from tests.support.playbook import Playbook
from tests.support.proxy import collect, error_of, running_proxy

TIMEOUT = 60.0  # hang guard only (a loaded 2-core box)
MiB = 1 << 20
BOMB_MIB = 1024  # what the bomb inflates to
PEAK_BOUND = 200 * MiB  # generous: the proxy holds at most max_event_bytes (4 MiB) and a few chunks of it
MCP = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def bomb() -> Iterator[bytes]:
    """A gzip stream of ``BOMB_MIB`` MiB of zeros, made without holding it inflated: the compressed block
    of one MiB of zeros after the first is the same every time (it refers only to zeros before it), so
    it is repeated. No gzip trailer: the proxy must stop reading long before."""
    deflate = zlib.compressobj(9, wbits=31)
    zeros = bytes(MiB)
    yield deflate.compress(zeros) + deflate.flush(zlib.Z_SYNC_FLUSH)
    block = deflate.compress(zeros) + deflate.flush(zlib.Z_SYNC_FLUSH)
    yield block * (BOMB_MIB - 1)  # about 1 MiB, one write: the proxy reads as much as its socket holds


def bombing() -> Playbook:
    """``initialize`` is answered plainly; every other request (a tool call, the standalone GET) with a
    gzip bomb, as SSE or (tool ``json``) as ``application/json``."""
    upstream = Playbook(session_ids=["bomb-session"])
    upstream.on(None, gzip_bomb("text/event-stream"), http=None)
    upstream.on(None, gzip_bomb("application/json"), when=lambda seen: seen.params.get("name") == "json")
    upstream.on("initialize", pb.initialize(name="bombs"))
    return upstream


def gzip_bomb(content_type: str) -> pb.Answer:
    """The bomb as a ``content_type`` body with ``Content-Encoding: gzip``, then held open (its gate is never
    opened: the proxy must end it)."""
    headers = {"Content-Type": content_type, "Content-Encoding": "gzip"}
    return pb.sse(write_bomb, pb.wait("bombed"), headers=headers)


async def write_bomb(steps: pb.Steps) -> None:
    """A step: the bomb, made as it is written."""
    for part in bomb():
        await steps.write(part)


def bombs(upstream: Playbook) -> int:
    """How many requests the upstream answered with its bomb."""
    return len([seen for seen in upstream.seen if seen.method != "initialize"])


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


@pytest.fixture
def peak_rss() -> Callable[[], int]:
    """Bytes the process's peak RSS rose by since the fixture began, over its RSS then."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM := VmRSS
    start = _status_kib("VmRSS")
    return lambda: (_status_kib("VmHWM") - start) * 1024


def assert_bounded(peak_rss: Callable[[], int]) -> None:
    rise = peak_rss()
    assert rise < PEAK_BOUND, f"peak RSS rose by {rise / MiB:.0f} MiB"


@dataclass
class Session:
    http: aiohttp.ClientSession
    url: str
    headers: dict[str, str]  # of the session, asking for gzip
    upstream: Playbook
    metrics: Metrics


@pytest.fixture
async def session(serve) -> AsyncIterator[Session]:
    upstream = bombing()
    url = await serve(upstream.app())
    async with running_proxy(url) as proxy, aiohttp.ClientSession() as http:
        gzip_client = {**MCP, "Accept-Encoding": "gzip, deflate"}
        async with http.post(proxy.url, data=orjson.dumps(INITIALIZE), headers=gzip_client) as response:
            assert response.status == 200
            session_id = response.headers["Mcp-Session-Id"]
        headers = {**gzip_client, "Mcp-Session-Id": session_id, "MCP-Protocol-Version": "2025-11-25"}
        yield Session(http, proxy.url, headers, upstream, proxy.ctx.metrics)


def _call(name: str) -> bytes:
    return orjson.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": name}})


async def test_a_gzip_bomb_as_a_posts_sse_answer_ends_its_stream_bounded(
    session: Session, peak_rss: Callable[[], int]
) -> None:
    http, url, headers, upstream = session.http, session.url, session.headers, session.upstream
    async with asyncio.timeout(TIMEOUT), http.post(url, data=_call("sse"), headers=headers) as response:
        assert response.status == 200
        answers = [orjson.loads(e.data) for e in await collect(response) if e.data]
    assert [a["id"] for a in answers] == [7]
    assert answers[0]["error"]["data"]["reason"] == "upstream_stream_lost"  # not 1 GiB of zeros
    assert sample(session.metrics, "mcpresume_upstream_errors_total", reason="event_too_large") == 1
    assert bombs(upstream) == 1
    assert_bounded(peak_rss)


async def test_a_gzip_bomb_as_a_json_answer_is_502_bounded(
    session: Session, peak_rss: Callable[[], int]
) -> None:
    http, url, headers, upstream = session.http, session.url, session.headers, session.upstream
    async with asyncio.timeout(TIMEOUT), http.post(url, data=_call("json"), headers=headers) as response:
        assert response.status == 502
        error = await error_of(response)
    assert error["data"]["reason"] == "upstream_bad_response"
    assert error["data"]["limit"] == 4 * MiB  # max_event_bytes: one JSON-RPC message, as one SSE event
    async with asyncio.timeout(TIMEOUT), http.post(url, data=_call("json"), headers=headers) as response:
        assert response.status == 409  # it ran upstream: never forwarded again
    assert bombs(upstream) == 1
    assert_bounded(peak_rss)


async def test_a_gzip_bomb_on_the_standalone_get_ends_the_stream_bounded(
    session: Session, peak_rss: Callable[[], int]
) -> None:
    http, url, headers, upstream = session.http, session.url, session.headers, session.upstream
    get = {k: v for k, v in headers.items() if k != "Content-Type"}
    async with asyncio.timeout(TIMEOUT), http.get(url, headers=get) as response:
        assert response.status == 200
        events = await collect(response)  # ends: the upstream's stream failed, nothing of it delivered
    assert [e.data for e in events if e.data] == []
    assert sample(session.metrics, "mcpresume_upstream_errors_total", reason="event_too_large") == 1
    assert bombs(upstream) == 1
    assert_bounded(peak_rss)
