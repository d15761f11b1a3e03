"""Protocol eras: which one a request speaks, which ones the upstream serves, and the handshake's version.

Two eras of Streamable HTTP matter (docs/reference.md, "Protocol eras"):

* the handshake era, 2025-03-26 to 2025-11-25: an ``initialize`` negotiates the version, the server may
  issue ``Mcp-Session-Id``, streams resume with ``Last-Event-ID``: the proxy's full resumption model;
* the modern era, 2026-07-28 (SEP-2567, SEP-2575): no sessions, no GET stream, no DELETE, no resumption;
  every request carries ``MCP-Protocol-Version: 2026-07-28`` and its envelope in ``params._meta``.

Which era the upstream speaks is learnt by the spec's probe, ``server/discover`` at 2026-07-28, sent at
start and again when the upstream's behaviour changes (``http/bridge.py`` sends; this module reads), and by
what the upstream answers a client's handshake ``initialize``. Its fallback rule (anything but a result naming
a modern version is no modern evidence: fall back to the handshake) gives the first two rows:

=====================================  ========================================  =================
``server/discover`` at 2026-07-28      the handshake era                         upstream era
=====================================  ========================================  =================
a 5xx, or no answer                    (any)                                     ``UNKNOWN``
not a result naming a modern version   (any)                                     ``HANDSHAKE``
a result naming a modern version       refused: an ``initialize`` answered 4xx   ``MODERN_ONLY``
                                       with -32022 whose data names no
                                       handshake version
a result naming a modern version       taken: an ``initialize`` answered 2xx     ``DUAL``
a result naming a modern version       not tried yet (or a 5xx, unreachable);    ``DUAL``
and a handshake-era one                it names a handshake version
a result naming a modern version only  not tried yet (or a 5xx, unreachable)     ``MODERN``
=====================================  ========================================  =================

``server/discover`` alone cannot tell a dual-era server from a modern-only one: the official SDK's dual
server lists only ``2026-07-28`` in ``supportedVersions`` (it negotiates the handshake era through
``initialize``). Hence ``MODERN`` until a client's ``initialize`` says which: a modern-only server refuses it
with -32022 "Unsupported protocol version" (its ``data.supported`` naming only modern versions). The probe
itself is a modern request, harmless to any server: a dual-era upstream is served as without the bridge.

The handshake's version negotiation (2025-06-18, lifecycle): the server answers with the version the
client asked for when it supports it, else with the latest it supports; the client then decides.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Final

MODERN_VERSION: Final = "2026-07-28"
MODERN_VERSIONS: Final[tuple[str, ...]] = (MODERN_VERSION,)
# Oldest first; what the proxy answers a bridged ``initialize`` with (2024-11-05 is the two-endpoint
# HTTP+SSE transport, out of scope).
HANDSHAKE_VERSIONS: Final[tuple[str, ...]] = ("2025-03-26", "2025-06-18", "2025-11-25")
LATEST_HANDSHAKE: Final = HANDSHAKE_VERSIONS[-1]

# The JSON-RPC code a 2026-07-28 server refuses a version with (the SDK: UNSUPPORTED_PROTOCOL_VERSION).
UNSUPPORTED_PROTOCOL_VERSION: Final = -32022


class Era(enum.Enum):
    """What a request speaks."""

    HANDSHAKE = "handshake"
    MODERN = "modern"


class UpstreamEra(enum.Enum):
    """What the upstream serves, as far as the probes told."""

    UNKNOWN = "unknown"  # not probed yet, or the probe failed (unreachable, 5xx): served as today
    HANDSHAKE = "handshake"  # no server/discover: a handshake-era server
    MODERN = "modern"  # speaks 2026-07-28; whether it takes the handshake era is not known yet
    DUAL = "dual"  # both eras: served as today
    MODERN_ONLY = "modern_only"  # refuses the handshake era: what the bridge is for


def request_era(version_header: str | None, method: str | None) -> Era:
    """The era of a client request, by its ``MCP-Protocol-Version`` (absent: 2025-03-26, per 2025-06-18)
    and its method (``server/discover`` is the modern era's probe)."""
    if version_header in MODERN_VERSIONS or method == "server/discover":
        return Era.MODERN
    return Era.HANDSHAKE


def negotiate(requested: object) -> str:
    """The version a bridged ``initialize`` is answered with: the client's when it is a handshake-era
    version, else the latest (the client then disconnects if it cannot speak it)."""
    if isinstance(requested, str) and requested in HANDSHAKE_VERSIONS:
        return requested
    return LATEST_HANDSHAKE


def discover_offers_modern(status: int, body: object) -> bool | None:
    """Whether a ``server/discover`` answer is a result naming a version of the modern era (None: a 5xx,
    which says nothing of the era)."""
    if status >= 500:
        return None
    if not 200 <= status < 300 or not isinstance(body, Mapping):
        return False
    result = body.get("result")
    if not isinstance(result, Mapping):
        return False
    versions = result.get("supportedVersions")
    return isinstance(versions, list) and any(v in MODERN_VERSIONS for v in versions)


def discover_lists_handshake(body: object) -> bool:
    """Whether a ``server/discover`` result names a handshake-era version too (a dual server says so)."""
    result = body.get("result") if isinstance(body, Mapping) else None
    versions = result.get("supportedVersions") if isinstance(result, Mapping) else None
    return isinstance(versions, list) and any(v in HANDSHAKE_VERSIONS for v in versions)


def initialize_refused(status: int, body: object) -> bool | None:
    """Whether a handshake ``initialize``'s answer refuses the handshake era: True (refused), False (taken),
    None (says nothing: a 5xx, a 4xx of another kind)."""
    if 200 <= status < 300:
        return False
    if not 400 <= status < 500:
        return None
    error = body.get("error") if isinstance(body, Mapping) else None
    if not isinstance(error, Mapping):
        return None
    if error.get("code") == UNSUPPORTED_PROTOCOL_VERSION:
        data: Any = error.get("data")
        supported = data.get("supported") if isinstance(data, Mapping) else None
        if isinstance(supported, list) and any(v in HANDSHAKE_VERSIONS for v in supported):
            return None  # it names a handshake version: not a modern-only refusal
        return True
    return None


def upstream_era(
    discover_modern: bool | None, refused: bool | None, lists_handshake: bool = False
) -> UpstreamEra:
    """The table in the module docstring: ``discover_modern`` as ``discover_offers_modern`` says,
    ``refused`` as ``initialize_refused`` says (None: not tried, or it said nothing), ``lists_handshake``
    as ``discover_lists_handshake``."""
    if discover_modern is None:
        return UpstreamEra.UNKNOWN
    if not discover_modern:
        return UpstreamEra.HANDSHAKE
    if refused is None:
        return UpstreamEra.DUAL if lists_handshake else UpstreamEra.MODERN
    return UpstreamEra.MODERN_ONLY if refused else UpstreamEra.DUAL
