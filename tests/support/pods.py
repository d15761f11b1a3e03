"""Pods for the scale-out tests: each an upstream of the official SDK (knowing only its own sessions) with a
proxy as its sidecar, all the proxies over one shared store, each registered at its own advertise URL."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

from mcpresume.daemon.app import RunningProxy, start_proxy
from mcpresume.examples.upstream import serve_example_upstream
from mcpresume.process.config import load_settings
from mcpresume.store import SessionStore

# Pods whose takeovers come within about two seconds: a lease of 1 s, and housekeeping (which takes a lost
# owner's sessions over) every second, a tenth of session_ttl. A replica takes sessions over only once the
# store has answered it for a whole lease, so with the defaults (a 10 s lease, 5 s rounds) a takeover comes
# about 10 s in: a test that waits for one with ``until`` (10 s) races its own timeout.
QUICK_TAKEOVER: Final[dict[str, Any]] = {"owner_lease_ttl": 1.0, "session_ttl": 10.0}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Pod:
    name: str
    upstream: str  # the pod's own upstream (its sidecar's --upstream)
    proxy: RunningProxy

    @property
    def url(self) -> str:
        return self.proxy.url


async def start_pod(name: str, upstream: str, store: SessionStore, **settings: Any) -> RunningProxy:
    port = free_port()
    values = {
        "upstream": upstream,
        "port": port,
        "metrics_port": 0,
        "replica_id": name,
        "advertise_url": f"http://127.0.0.1:{port}/mcp",
        "drain_timeout": 0.5,
        **settings,
    }
    return await start_proxy(load_settings(values), store=store)


@contextlib.asynccontextmanager
async def pods(
    store: SessionStore, count: int, shared_upstream: str | None = None, **settings: Any
) -> AsyncIterator[list[Pod]]:
    """``count`` pods (a, b, c, ...) over ``store``, each with its own upstream (the sidecar layout), or
    all in front of ``shared_upstream`` (a proxy tier in front of one logical server)."""
    async with contextlib.AsyncExitStack() as stack:
        running: list[Pod] = []
        for index in range(count):
            name = "pod-" + "abcdefgh"[index]
            upstream = shared_upstream or await stack.enter_async_context(serve_example_upstream(name=name))
            proxy = await start_pod(name, upstream, store, **settings)
            stack.push_async_callback(proxy.stop)  # a no-op for one stopped (or killed) already
            running.append(Pod(name, upstream, proxy))
        yield running


class _NoRelease:
    """A registry that forgets nothing: a killed process releases no lease."""

    async def release_replica(self, replica_id: str) -> None:
        return None

    async def register_replica(
        self, replica_id: str, url: str, ttl: float, now: float, instance: str = ""
    ) -> None:
        return None

    async def live_replicas(self, now: float) -> int:
        return 0


async def kill(proxy: RunningProxy) -> None:
    """As ``kill -9`` leaves things, in this process: the pumps stop mid-stream without ending their
    streams, the lease is neither renewed nor released, the listener goes (clients' connections end)."""
    ctx = proxy.ctx
    assert ctx.lease is not None
    ctx.lease.registry = _NoRelease()
    await ctx.pumps.drain(0, hand_over=True)
    await proxy.stop()
