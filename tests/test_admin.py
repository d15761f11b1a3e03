"""The admin listener of a real proxy: what /metrics exports beside the proxy's own counters, and /readyz
with and without ``ready_on_upstream``."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from mcpresume import __version__
from tests.support.pods import free_port
from tests.support.poll import until
from tests.support.proxy import ScriptedClient, running_proxy


async def _scrape(http: aiohttp.ClientSession, admin_url: str | None) -> str:
    assert admin_url is not None
    async with http.get(f"{admin_url}/metrics") as response:
        assert response.status == 200
        return await response.text()


async def test_metrics_carry_the_build_and_the_process_and_no_created_series(example_upstream: str) -> None:
    async with (
        running_proxy(example_upstream, metrics_port=free_port()) as proxy,
        aiohttp.ClientSession() as http,
    ):
        await ScriptedClient(http, proxy.url).initialize()  # counters and a histogram with samples
        text = await _scrape(http, proxy.admin_url)
    lines = text.splitlines()
    assert f'mcpresume_build_info{{version="{__version__}"}} 1.0' in lines
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds"):
        assert any(line.startswith(f"{name} ") for line in lines), name
    assert any(line.startswith('mcpresume_requests_total{method="POST",status="200"}') for line in lines)
    assert any(line.startswith("mcpresume_resume_latency_seconds_count") for line in lines)
    assert not [line for line in lines if "_created" in line]  # no series, no HELP or TYPE of one


async def test_readiness_on_the_upstream_follows_it_only_when_asked() -> None:
    """Off (the default), /readyz does not ask the upstream; on, an upstream that does not answer HTTP
    makes the replica not ready, and ready again once it answers (any status: here 405)."""

    posts: list[str] = []

    async def post(request: web.Request) -> web.Response:
        posts.append(request.headers.get("Mcp-Method", ""))
        return web.Response(status=202)

    app = web.Application()
    app.router.add_post("/mcp", post)  # a bare GET: 405
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    upstream = f"http://127.0.0.1:{port}/mcp"

    async def readyz(http: aiohttp.ClientSession, admin_url: str | None) -> int:
        async with http.get(f"{admin_url}/readyz") as response:
            return response.status

    try:
        async with (
            running_proxy(upstream, metrics_port=free_port()) as plain,
            running_proxy(upstream, metrics_port=free_port(), ready_on_upstream=True) as sidecar,
            aiohttp.ClientSession() as http,
        ):
            assert await readyz(http, plain.admin_url) == 200
            assert await readyz(http, sidecar.admin_url) == 200
            # The era probe at start leaves a kept-alive connection in the proxies' pool: it must not
            # answer for the listener once it is gone.
            await until(lambda: len(posts) >= 2, what="both proxies' era probes")
            await site.stop()  # the upstream is down: nothing listens on its port
            assert await readyz(http, plain.admin_url) == 200
            assert await readyz(http, sidecar.admin_url) == 503
            site = web.TCPSite(runner, "127.0.0.1", port)
            await site.start()  # back
            assert await readyz(http, sidecar.admin_url) == 200
    finally:
        await runner.cleanup()
