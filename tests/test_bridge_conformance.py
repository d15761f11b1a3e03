"""The conformance suite's server scenarios (handshake era: the suite's client is the TypeScript SDK's)
against the conformance upstream made 2026-07-28-only (tests/support/modern_upstream.py's guard; serving
``subscriptions/listen``, so resources-subscribe/unsubscribe run over the listen stream), through the era
bridge. Each scenario passes as against a dual-era upstream, but those `NOT_BRIDGEABLE` lists,
whose reason is the upstream's side of the era change, not the proxy's."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from tests.support.conformance import (
    SERVER_SCENARIOS,
    Runner,
    ScenarioResult,
    Unavailable,
    find_runner,
    run_suite,
)
from tests.support.conformance_upstream import upstream_process
from tests.support.proxy import running_proxy

pytestmark = pytest.mark.conformance

NOT_BRIDGEABLE: dict[str, str] = {
    # The conformance upstream asks the client through the handshake era's back channel (a request on the
    # call's stream); on the 2026-07-28 path the SDK has none (NoBackChannelError): a modern-only server
    # asks with an input-required result, which the bridge does turn into these requests
    # (tests/test_bridge.py, the elicitation through MRTR).
    "tools-call-sampling": "the upstream's sampling needs the handshake era's back channel",
    "tools-call-elicitation": "the upstream's elicitation needs the handshake era's back channel",
    "elicitation-sep1034-defaults": "the upstream's elicitation needs the handshake era's back channel",
    "elicitation-sep1330-enums": "the upstream's elicitation needs the handshake era's back channel",
}


@pytest.fixture(scope="module")
def bridged() -> dict[str, ScenarioResult]:
    try:
        runner = find_runner(install=True)
    except Unavailable as exc:
        if exc.skip:
            pytest.skip(str(exc))
        pytest.fail(str(exc), pytrace=False)

    async def run(found: Runner) -> dict[str, ScenarioResult]:
        async with upstream_process(modern_only=True) as upstream, running_proxy(upstream) as proxy:
            return await run_suite(found, proxy.url)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as loop:
        return loop.run(run(runner))


@pytest.mark.parametrize("scenario", SERVER_SCENARIOS)
def test_scenario_through_the_bridge(bridged: dict[str, ScenarioResult], scenario: str) -> None:
    assert scenario in bridged, f"{scenario} did not run"
    result = bridged[scenario]
    if scenario in NOT_BRIDGEABLE:
        assert not result.passed, f"{scenario} passes now: drop it from NOT_BRIDGEABLE"
    else:
        assert result.passed, f"{scenario}: {result.failures} {result.messages[:3]}"
