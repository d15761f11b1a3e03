"""The official MCP conformance suite gives, scenario by scenario, the same verdicts through the proxy as
directly against the upstream.

The runner is npm ``@modelcontextprotocol/conformance`` (pinned, installed outside the repository by
``.ci/run``; see tests/support/conformance.py). Its server scenarios act as a TypeScript-SDK client; the
upstream is an official Python SDK server that offers every tool, resource and prompt they call
(tests/support/conformance_upstream.py), in a process of its own, as a real upstream is: run in the proxy's
event loop it cannot read the proxy's connections in another order than the proxy wrote them, and hid that
the standalone GET, written first on a new connection, may be read after the call that followed it on an
open one (issue 30 item 8). The suite's own fixture server (TypeScript), which showed that, is published
only in the suite's repository, not on npm; the Python one stands in for it (and shows the race far less
often: `STANDALONE_ROUNDS`). The test skips only when Node is missing or too old; a missing runner fails it,
with the command that installs it.

A known difference would be pinned as a strict xfail (``KNOWN_FAILING_THROUGH_PROXY``), with the issue
item that removes it; none is today (items 15 and 16 removed the last two: an upstream whose DNS-rebinding
check reads ``Host`` alone, and one that sends its elicitation/sampling requests on the standalone stream).

Select with ``-m conformance``. Under a minute (one suite run of a few seconds directly and one through the
proxy; the ordering check's 28 runs of about a second each, 12 on each store and 4 directly).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

import pytest
import uvloop

from tests.support.conformance import (
    SERVER_SCENARIOS,
    Runner,
    ScenarioResult,
    Unavailable,
    find_runner,
    format_table,
    list_server_scenarios,
    run_scenario,
    run_suite,
)
from tests.support.conformance_upstream import HostCheck, ServerRequests, upstream_process
from tests.support.proxy import running_proxy
from tests.support.redis import free_port

pytestmark = pytest.mark.conformance

T = TypeVar("T")
ProxyOrNot = Literal["direct", "proxied"]
Verdicts = dict[str, ScenarioResult]

KNOWN_FAILING_THROUGH_PROXY: dict[str, str] = {}
"""What is known to fail through the proxy and not directly, each with the issue item whose fix makes it
pass; each is a strict xfail, so remove its entry when that fix merges. Keys: a scenario name (the SDK
upstream's per-scenario comparison; none today: ``dns-rebinding-protection`` passes through the proxy there
because the Python SDK also checks ``Origin``, which the proxy forwards as it came), or one of the two
checks below, ``standalone-stream-requests`` and ``host-only-dns-rebinding``."""


def known_failing(key: str, raises: type[BaseException] = AssertionError) -> pytest.MarkDecorator:
    """The strict xfail of a `KNOWN_FAILING_THROUGH_PROXY` entry; without the entry, the module's mark."""
    reason = KNOWN_FAILING_THROUGH_PROXY.get(key)
    if reason is None:
        return pytest.mark.conformance
    return pytest.mark.xfail(strict=True, raises=raises, reason=reason)


STANDALONE_SCENARIOS: tuple[str, ...] = (
    "tools-call-elicitation",
    "tools-call-sampling",
    "elicitation-sep1034-defaults",
    "elicitation-sep1330-enums",
)
"""The scenarios whose upstream sends a request to the client (elicitation, sampling) during the call."""

STANDALONE_ROUNDS = 3
"""Runs of each `STANDALONE_SCENARIOS` scenario through the proxy, on each store (24 runs in all, about half
a minute). A lost request is a race: the call overtakes the client's standalone GET, in the proxy (while the
GET asks a shared store what it is) or at the upstream (which reads the GET, written to a new connection,
after the call written to an open one). By hand on this 2-core machine, 100 runs each before issue 30 item
8's fix: this upstream in a process of its own lost 0 on the memory store and 2 on Redis; the suite's
TypeScript fixture server (not on npm) lost 9 and 11. After it, 0 of 120 runs each, all four ways. So this
check seldom catches the race; tests/test_streams.py holds the GET at each point instead
(``test_a_call_waits_*``) and catches it every time."""


def _on_uvloop(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``main`` on a fresh uvloop, the daemon's loop (the suite is one run, not one per loop)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


@pytest.fixture(scope="module")
def runner() -> Runner:
    try:
        found = find_runner(install=True)
    except Unavailable as exc:
        if exc.skip:
            pytest.skip(str(exc))
        pytest.fail(str(exc), pytrace=False)
    listed = _on_uvloop(lambda: list_server_scenarios(found))
    assert listed == list(SERVER_SCENARIOS), "the runner's server scenarios changed: update SERVER_SCENARIOS"
    return found


async def _direct_and_proxied(runner: Runner, server_requests: ServerRequests) -> tuple[Verdicts, Verdicts]:
    async with upstream_process(server_requests=server_requests) as upstream:
        direct = await run_suite(runner, upstream)
        async with running_proxy(upstream) as proxy:
            proxied = await run_suite(runner, proxy.url)
    return direct, proxied


async def _scenario_direct_and_proxied(
    runner: Runner, scenario: str, host_check: HostCheck
) -> tuple[ScenarioResult, ScenarioResult]:
    async with upstream_process(host_check=host_check) as upstream:
        direct = await run_scenario(runner, upstream, scenario)
        async with running_proxy(upstream) as proxy:
            proxied = await run_scenario(runner, proxy.url, scenario)
    return direct, proxied


@pytest.fixture(scope="module")
def suite(runner: Runner) -> tuple[Verdicts, Verdicts]:
    """Every scenario once directly against the SDK upstream, then once through a proxy in front of it."""
    direct, proxied = _on_uvloop(lambda: _direct_and_proxied(runner, "call"))
    rows = [(name, (direct.get(name), proxied.get(name))) for name in SERVER_SCENARIOS]
    print("\n" + format_table(["direct", "through mcpresume"], rows))
    return direct, proxied


@pytest.mark.parametrize(
    "scenario", [pytest.param(name, marks=known_failing(name)) for name in SERVER_SCENARIOS]
)
def test_scenario_same_through_proxy(suite: tuple[Verdicts, Verdicts], scenario: str) -> None:
    direct, proxied = suite
    assert scenario in direct, f"{scenario} did not run against the upstream"
    assert scenario in proxied, f"{scenario} did not run through the proxy"
    assert direct[scenario].passed, f"fails against the upstream itself: {direct[scenario].messages}"
    assert proxied[scenario].passed == direct[scenario].passed, (
        f"{scenario}: direct {direct[scenario].verdict}, through the proxy {proxied[scenario].verdict}: "
        f"{proxied[scenario].messages}"
    )


class LostServerRequest(AssertionError):
    """A run through the proxy failed because the upstream's request never reached the client."""


async def _standalone_runs(
    runner: Runner, rounds: int, url_of: ProxyOrNot, **settings: Any
) -> list[ScenarioResult]:
    """Each of `STANDALONE_SCENARIOS` ``rounds`` times against the standalone-stream upstream, directly or
    through a proxy (with ``settings``); stops at the first failed run."""
    results: list[ScenarioResult] = []
    async with contextlib.AsyncExitStack() as stack:
        url = upstream = await stack.enter_async_context(upstream_process(server_requests="standalone"))
        if url_of == "proxied":
            url = (await stack.enter_async_context(running_proxy(upstream, **settings))).url
        for _round in range(rounds):
            for scenario in STANDALONE_SCENARIOS:
                results.append(await run_scenario(runner, url, scenario))
                if not results[-1].passed:
                    return results
    return results


def test_standalone_stream_upstream_passes_directly(runner: Runner) -> None:
    """The upstream of the ordering check below passes its scenarios when the client talks to it itself."""
    results = _on_uvloop(lambda: _standalone_runs(runner, 1, "direct"))
    assert [r.scenario for r in results] == list(STANDALONE_SCENARIOS)
    assert all(r.passed for r in results), [r.messages for r in results]


@known_failing("standalone-stream-requests", raises=LostServerRequest)
@pytest.mark.parametrize("store", ["memory", "redis"])
def test_server_requests_on_the_standalone_stream_survive_the_proxy(
    runner: Runner, store: str, request: pytest.FixtureRequest
) -> None:
    """An upstream that sends its elicitation / sampling request on the standalone GET stream (as the suite's
    reference server does) needs that GET to reach it before the call; directly it does (the test above).
    Through the proxy, every run of every such scenario must pass too, on either store (a real
    ``redis-server``: a shared store's round trips are where the call overtook the GET in the proxy)."""
    settings: dict[str, Any] = {}
    if store == "redis":
        port = free_port()
        settings = {
            "store": request.getfixturevalue("redis_db"),
            "port": port,
            "advertise_url": f"http://127.0.0.1:{port}/mcp",
        }
    results = _on_uvloop(lambda: _standalone_runs(runner, STANDALONE_ROUNDS, "proxied", **settings))
    failed = [r for r in results if not r.passed]
    if not failed:
        assert len(results) == STANDALONE_ROUNDS * len(STANDALONE_SCENARIOS)
        return
    first = failed[0]
    lost = any("did not request" in message for message in first.messages)
    error = LostServerRequest if lost else AssertionError
    raise error(
        f"through the proxy, run {len(results)} of up to {STANDALONE_ROUNDS * len(STANDALONE_SCENARIOS)}"
        f" failed: {first}"
    )


class WeakenedCheck(AssertionError):
    """The upstream rejects a request directly that it accepts through the proxy."""


@known_failing("host-only-dns-rebinding", raises=WeakenedCheck)
def test_host_only_dns_rebinding_check_holds_through_proxy(runner: Runner) -> None:
    """An upstream whose DNS-rebinding protection reads ``Host`` alone (the TypeScript SDK's) rejects
    ``Host: evil.example.com`` directly; through the proxy it must be rejected too."""
    direct, proxied = _on_uvloop(
        lambda: _scenario_direct_and_proxied(runner, "dns-rebinding-protection", "host-only")
    )
    assert direct.passed, f"fails against the upstream itself: {direct.messages}"
    if not proxied.passed:
        raise WeakenedCheck(f"through the proxy: {proxied.messages}")
