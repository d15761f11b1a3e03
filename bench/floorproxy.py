"""The floor proxy: the thinnest reverse proxy aiohttp makes, what any proxy built on it costs per request.

``python -m bench.floorproxy --upstream URL --port P`` (uvloop, loopback only; prints ``READY <port>``).
Each request: read the body, send it upstream on a pooled keep-alive connection (one
``aiohttp.ClientSession``), and stream the answer back as it comes (``StreamResponse``, one write per chunk
read), the hop-by-hop headers dropped both ways. Nothing else: no sessions, no parsing, no time-outs but
aiohttp's own, no access log. The calls scenario (``python -m bench --only calls``) measures mcpresume
against it: what mcpresume spends per call above this is its own.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import aiohttp
import uvloop
from aiohttp import web
from yarl import URL

# RFC 9110 section 7.6.1: these describe one connection, not the message, and do not cross a proxy. Host
# and Content-Length are the client library's to write for the upstream request.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_UPSTREAM = web.AppKey("upstream", URL)
_CLIENT = web.AppKey("client", aiohttp.ClientSession)


async def relay(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
    target = request.app[_UPSTREAM].with_path(request.path).with_query(request.query)
    async with request.app[_CLIENT].request(request.method, target, data=body, headers=headers) as answer:
        response = web.StreamResponse(status=answer.status, reason=answer.reason)
        for name, value in answer.headers.items():
            if name.lower() not in HOP_BY_HOP or name.lower() == "content-length":
                response.headers.add(name, value)
        await response.prepare(request)
        async for chunk in answer.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


async def serve(upstream: str, host: str, port: int) -> None:
    app = web.Application()
    app[_UPSTREAM] = URL(upstream)
    app[_CLIENT] = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None),
    )
    app.router.add_route("*", "/{tail:.*}", relay)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    print(f"READY {runner.addresses[0][1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await app[_CLIENT].close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.floorproxy", description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="the upstream's URL (its origin is used)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    if not args.host.startswith("127."):
        print("bench.floorproxy: loopback only", file=sys.stderr)
        return 2
    uvloop.run(serve(args.upstream, args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
