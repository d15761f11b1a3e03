"""What it takes to begin a session again upstream, and what to replay (pure: issue #33).

Under ``upstream_session_lost = "reinitialize"`` the proxy keeps with each session a ``Recipe``: the
client's ``initialize`` params, what the upstream told the client in return (its protocol version and
capabilities, once known), and the state the session-shaping requests the upstream accepted left behind.
The shaping requests are folded, not logged: the recipe stays small whatever the session does, and
replaying it is the state, not the history (``logging/setLevel`` keeps its last level, ``resources/subscribe``
and ``unsubscribe`` the set of subscribed URIs):

=============================  ==========================================================================
request (accepted upstream)    what the recipe keeps (``fold``)
=============================  ==========================================================================
``initialize``                 ``begin``: its params, nothing else yet
``logging/setLevel``           its ``level`` (the last one wins)
``resources/subscribe``        its ``uri`` added to the subscriptions
``resources/unsubscribe``      its ``uri`` removed
a standalone GET opened/ended  ``standalone`` (``with_standalone``)
anything else, or params       nothing (``fold`` answers None: no store write)
it cannot read
=============================  ==========================================================================

``replay`` is what is sent to begin again, in order: ``initialize`` with the recorded params,
``notifications/initialized``, the level, each subscription (sorted: a replay is deterministic). The
standalone GET is no step of it: the session's live standalone stream, if there is one, is opened again in
the new upstream session by its own pump once the session is begun again (``streams/pump.py``), so the
client's view of it goes on as the same stream.

``judge`` holds the new upstream's answer to the initialize against what the client was told
(``Outcome``): another protocol version, or fewer capabilities, ends the session instead, since the client
would go on under terms the upstream no longer offers. ``list_changed`` names the notifications the client
is sent afterwards (the new upstream may list other tools, prompts, resources), only those the capabilities
the client was told allow.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

import orjson

SET_LEVEL: Final = "logging/setLevel"
SUBSCRIBE: Final = "resources/subscribe"
UNSUBSCRIBE: Final = "resources/unsubscribe"
SHAPING: Final = frozenset({SET_LEVEL, SUBSCRIBE, UNSUBSCRIBE})
"""The session-shaping requests: a recipe is written only on these and on ``initialize``."""

INITIALIZED: Final = "notifications/initialized"
_LISTS: Final = ("tools", "prompts", "resources")


@dataclass(frozen=True, slots=True)
class Recipe:
    """What it takes to begin one session again upstream."""

    params: Mapping[str, Any]  # the client's initialize params, as it sent them
    level: str | None = None  # the last logging/setLevel the upstream accepted
    subscriptions: frozenset[str] = frozenset()  # the resource URIs subscribed to now
    standalone: bool = False  # a standalone GET was open
    version: str | None = None  # the protocol version the upstream told the client (once known)
    capabilities: Mapping[str, Any] | None = None  # the server capabilities the client was told
    # A session of the era bridge's (http/bridge.py): the proxy answered its initialize, and every replica
    # sends its requests with the client's facts this recipe keeps (never begun again upstream: none has it).
    bridged: bool = False

    def encode(self) -> bytes:
        """The recipe as the store keeps it (compare-and-set compares these bytes: sorted keys)."""
        fields = {
            "params": self.params,
            "level": self.level,
            "subscriptions": sorted(self.subscriptions),
            "standalone": self.standalone,
            "version": self.version,
            "capabilities": self.capabilities,
        }
        if self.bridged:  # only then: a recipe of any other session is the same bytes as before the flag
            fields["bridged"] = True
        return orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)

    @classmethod
    def decode(cls, data: bytes) -> Recipe:
        raw = orjson.loads(data)
        return cls(
            params=raw["params"],
            level=raw["level"],
            subscriptions=frozenset(raw["subscriptions"]),
            standalone=raw["standalone"],
            version=raw["version"],
            capabilities=raw["capabilities"],
            bridged=raw.get("bridged", False) is True,
        )


def begin(params: Any) -> Recipe | None:
    """The recipe an ``initialize`` starts (None: params that are not an object, nothing to begin with)."""
    return Recipe(params=params) if isinstance(params, dict) else None


def told(recipe: Recipe, result: Any) -> Recipe | None:
    """What the upstream's ``initialize`` result told the client: kept to judge a new upstream by. None
    when the result cannot be read (the recipe stays without it)."""
    if not isinstance(result, dict):
        return None
    version, capabilities = result.get("protocolVersion"), result.get("capabilities")
    if not isinstance(version, str) or not isinstance(capabilities, dict):
        return None
    return replace(recipe, version=version, capabilities=capabilities)


def fold(recipe: Recipe, method: str, params: Any) -> Recipe | None:
    """The recipe after a request the upstream accepted; None when it changes nothing (not a shaping
    request, params it cannot read, or the state it leaves is already the recipe's)."""
    if method not in SHAPING or not isinstance(params, dict):
        return None
    if method == SET_LEVEL:
        level = params.get("level")
        if not isinstance(level, str) or level == recipe.level:
            return None
        return replace(recipe, level=level)
    uri = params.get("uri")
    if not isinstance(uri, str):
        return None
    added, removed = recipe.subscriptions | {uri}, recipe.subscriptions - {uri}
    subscriptions = added if method == SUBSCRIBE else removed
    return None if subscriptions == recipe.subscriptions else replace(recipe, subscriptions=subscriptions)


def with_standalone(recipe: Recipe, open_: bool) -> Recipe | None:
    """The recipe once a standalone GET opened (``open_``) or ended; None when it says so already."""
    return None if recipe.standalone == open_ else replace(recipe, standalone=open_)


@dataclass(frozen=True, slots=True)
class Step:
    """One message of a replay: a request (an answer awaited) or a notification."""

    method: str
    params: Mapping[str, Any] | None
    notification: bool = False


def replay(recipe: Recipe) -> tuple[Step, ...]:
    """The messages that begin the session again, in order (the standalone stream's pump opens it again)."""
    steps = [Step("initialize", recipe.params), Step(INITIALIZED, None, notification=True)]
    if recipe.level is not None:
        steps.append(Step(SET_LEVEL, {"level": recipe.level}))
    steps += [Step(SUBSCRIBE, {"uri": uri}) for uri in sorted(recipe.subscriptions)]
    return tuple(steps)


class Outcome(enum.Enum):
    """How a re-initialization ended: the label of ``mcpresume_upstream_reinitializations_total``, and
    (but ``REINITIALIZED``) the reason the session ended instead."""

    REINITIALIZED = "reinitialized"
    REFUSED = "refused"  # the upstream refused the initialize, or a shaping request
    VERSION_CHANGED = "version_changed"  # it negotiated another protocol version than the client's
    FEWER_CAPABILITIES = "fewer_capabilities"  # it offers less than the client was told
    SUPERSEDED = "superseded"  # another replica mapped the session to its upstream session first


def covers(offered: Any, told_: Any) -> bool:
    """Whether capabilities ``offered`` include all of ``told_``: each key told is offered, each flag told
    true is offered true, recursively (more offered is fine)."""
    if isinstance(told_, dict):
        if not isinstance(offered, dict):
            return False
        return all(key in offered and covers(offered[key], value) for key, value in told_.items())
    if told_ is True:
        return offered is True
    return True  # a value that is no flag (a version string, a list): present is enough


def judge(recipe: Recipe, result: Any) -> Outcome:
    """The new upstream's ``initialize`` result held against what the client was told. A recipe that never
    learnt it (the first answer was not read) is judged on the result alone being readable."""
    if not isinstance(result, dict):
        return Outcome.REFUSED
    version, capabilities = result.get("protocolVersion"), result.get("capabilities")
    if not isinstance(version, str) or not isinstance(capabilities, dict):
        return Outcome.REFUSED
    if recipe.version is not None and version != recipe.version:
        return Outcome.VERSION_CHANGED
    if recipe.capabilities is not None and not covers(capabilities, recipe.capabilities):
        return Outcome.FEWER_CAPABILITIES
    return Outcome.REINITIALIZED


def list_changed(recipe: Recipe) -> tuple[str, ...]:
    """The ``*/list_changed`` notifications the client is sent after a re-initialization: those whose
    capability the client was told has ``listChanged`` (none when it was never learnt)."""
    capabilities = recipe.capabilities or {}
    names = []
    for name in _LISTS:
        capability = capabilities.get(name)
        if isinstance(capability, dict) and capability.get("listChanged") is True:
            names.append(f"notifications/{name}/list_changed")
    return tuple(names)
