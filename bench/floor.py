"""What the framework alone costs per held SSE stream: ``python -m bench.floor [--streams N]``.

A proxy view of an attached stream holds two HTTP connections: the client's (an aiohttp server response)
and the upstream's (an aiohttp client response). This measures each half with nothing of mcpresume in it,
so the "attached idle stream" figure of ``python -m bench`` can be read against the floor it cannot go
below while it is built on aiohttp:

* server half: a bare aiohttp application (uvloop) whose handler prepares an SSE ``StreamResponse``, writes
  one comment and waits; N raw connections from a child process hold such responses open.
* client half: a bare ``aiohttp.ClientSession`` (uvloop) holding N streaming GET responses open against a
  raw asyncio server in a child process that sends the headers and one chunk.
* held-GET half: the same, held by mcpresume's own reader of long-lived upstream GETs
  (``mcpresume.streams.heldget``, what the proxy uses for a standalone stream), for comparison.

Each half is the RSS growth of the measuring process over N held streams (after 50 for warm-up), divided
by N, each half in a fresh process (memory one half freed would be reused by the next and hide it).
Loopback only; children die with this process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import uvloop
from aiohttp import web

from bench.procs import LOOPBACK, raise_fd_limit, rss_kib

_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"6\r\n: hi\n\n\r\n"
)
_REQUEST = b"GET / HTTP/1.1\r\nHost: bench\r\nAccept: text/event-stream\r\n\r\n"
WARM_UP = 50


def _rss_bytes() -> int:
    return rss_kib(os.getpid()) * 1024


async def _child(role: str, port: int, count: int) -> None:
    """``hold-clients``: open ``count`` raw connections to ``port`` and keep them. ``serve``: a raw server
    sending SSE headers and one chunk to every GET, printing its port."""
    raise_fd_limit()
    kept: list[asyncio.StreamWriter] = []
    if role == "serve":

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(_SSE_HEAD)
            kept.append(writer)

        server = await asyncio.start_server(handle, LOOPBACK, 0)
        print(server.sockets[0].getsockname()[1], flush=True)
    else:
        for index in range(WARM_UP + count):
            reader, writer = await asyncio.open_connection(LOOPBACK, port)
            writer.write(_REQUEST)
            await reader.readuntil(b": hi\n\n")
            kept.append(writer)
            if index + 1 == WARM_UP:
                print("warm", flush=True)
                await asyncio.sleep(0.5)
        print("held", flush=True)
    await asyncio.sleep(3600)


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.floor", *args, stdout=asyncio.subprocess.PIPE
    )


async def server_half(count: int) -> float:
    async def hold(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b": hi\n\n")
        await asyncio.sleep(3600)
        return response

    app = web.Application()
    app.router.add_get("/", hold)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, LOOPBACK, 0)
    await site.start()
    port = runner.addresses[0][1]
    child = await _spawn("--child", "hold-clients", "--port", str(port), "--streams", str(count))
    try:
        assert child.stdout is not None
        await child.stdout.readline()  # warm
        gc.collect()
        base = _rss_bytes()
        await child.stdout.readline()  # held
        await asyncio.sleep(1)
        gc.collect()
        return (_rss_bytes() - base) / count
    finally:
        child.kill()
        await child.wait()
        await runner.cleanup()


@contextlib.asynccontextmanager
async def _serving() -> AsyncIterator[int]:
    """The raw SSE server in a child process; yields its port."""
    child = await _spawn("--child", "serve")
    try:
        assert child.stdout is not None
        yield int(await child.stdout.readline())
    finally:
        child.kill()
        await child.wait()


async def _per_stream(count: int, open_one: Callable[[], Awaitable[Callable[[], object]]]) -> float:
    """RSS growth per stream over ``count`` held streams (after WARM_UP); ``open_one`` opens one and returns
    how to close it."""
    closers = [await open_one() for _ in range(WARM_UP)]
    gc.collect()
    base = _rss_bytes()
    closers += [await open_one() for _ in range(count)]
    await asyncio.sleep(1)
    gc.collect()
    per_stream = (_rss_bytes() - base) / count
    for close in closers:
        close()
    return per_stream


async def client_half(count: int) -> float:
    async with _serving() as port, aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one() -> Callable[[], object]:
            response = await session.get(
                f"http://{LOOPBACK}:{port}/", headers={"Accept": "text/event-stream"}
            )
            await response.content.readuntil(b"\n\n")
            return response.close

        return await _per_stream(count, one)


async def held_half(count: int) -> float:
    from mcpresume.streams.upstream import Upstream

    async with _serving() as port:
        upstream = Upstream(f"http://{LOOPBACK}:{port}/", connect_timeout=10, first_byte_timeout=10)

        async def one() -> Callable[[], object]:
            response = await upstream.open_get("/", [("Accept", "text/event-stream")])
            await response.readany()  # the one chunk (as the proxy's pump reads it: the head let go)
            return response.release

        return await _per_stream(count, one)


HALVES = {"server": server_half, "client": client_half, "held": held_half}


async def measure_half(name: str, count: int) -> float:
    """One half in a process of its own: memory another half freed would otherwise be reused and hide."""
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.floor",
        "--half",
        name,
        "--streams",
        str(count),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await child.communicate()
    if child.returncode != 0:
        raise RuntimeError(f"bench.floor --half {name} exited with {child.returncode}")
    return float(out.decode().split()[-1])


async def one_half(name: str, count: int) -> None:
    raise_fd_limit()
    print(await HALVES[name](count), flush=True)


async def main(count: int) -> None:
    server = await measure_half("server", count)
    client = await measure_half("client", count)
    held = await measure_half("held", count)
    print(f"aiohttp server half: {server:,.0f} B per held SSE response ({count:,} streams)")
    print(f"aiohttp client half: {client:,.0f} B per held streaming response ({count:,} streams)")
    print(f"both halves, nothing of mcpresume: {server + client:,.0f} B = {(server + client) / 1024:.1f} KiB")
    print(f"mcpresume's held GET instead of the client half: {held:,.0f} B per held streaming response")
    print(f"aiohttp server half + held GET: {server + held:,.0f} B = {(server + held) / 1024:.1f} KiB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=5000)
    parser.add_argument("--half", choices=sorted(HALVES), help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=["hold-clients", "serve"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        uvloop.run(_child(args.child, args.port, args.streams))
    elif args.half:
        uvloop.run(one_half(args.half, args.streams))
    else:
        uvloop.run(main(args.streams))
