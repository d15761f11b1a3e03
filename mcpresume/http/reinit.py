"""``upstream_session_lost = "reinitialize"``: the recording of what it takes to begin a session again
upstream (``core/reinit.py`` decides what a request adds to a session's recipe; this module keeps it in the
store, by compare-and-set, so two requests of one session on two replicas never lose each other's).

Recorded only on an ``initialize`` that began a session and on the session-shaping requests
(``core.reinit.SHAPING``) the upstream answered 2xx, and when a standalone GET opens: under the default
``end`` nothing is parsed and the store is never asked. A shaping request is recorded once the upstream
took it (2xx), before its JSON-RPC answer: one the upstream answers with an error is replayed into the same
error, which leaves the new upstream session as the old one was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

import orjson

from mcpresume.core.errors import ProxyError
from mcpresume.core.reinit import SHAPING, Recipe, begin, fold, with_standalone
from mcpresume.http.context import ProxyContext
from mcpresume.process.logs import log_id

log = logging.getLogger("mcpresume.proxy")

ATTEMPTS: Final = 8  # compare-and-set rounds before giving up (each lost round: another writer progressed)


def recording(ctx: ProxyContext) -> bool:
    return ctx.settings.upstream_session_lost == "reinitialize"


def _messages(body: bytes) -> list[Any]:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return []
    return doc if isinstance(doc, list) else [doc]


async def began(ctx: ProxyContext, session_id: str, epoch: str, body: bytes) -> None:
    """An ``initialize`` began the session: its params start the recipe."""
    if not recording(ctx):
        return
    params = next(
        (m.get("params") for m in _messages(body) if isinstance(m, dict) and m.get("method") == "initialize"),
        None,
    )
    recipe = begin(params)
    if recipe is not None:
        await _keep(ctx, session_id, epoch, lambda _: recipe, first=True)


async def shaped(
    ctx: ProxyContext, session_id: str, epoch: str, methods: tuple[str, ...], body: bytes
) -> None:
    """The upstream answered 2xx to a POST of the session: its shaping requests folded into the recipe."""
    if not recording(ctx) or SHAPING.isdisjoint(methods):
        return
    requests = [
        (m["method"], m.get("params"))
        for m in _messages(body)
        if isinstance(m, dict) and m.get("method") in SHAPING and "id" in m
    ]

    def change(recipe: Recipe) -> Recipe | None:
        changed = None
        for method, params in requests:
            changed = fold(changed or recipe, method, params) or changed
        return changed

    await _keep(ctx, session_id, epoch, change)


async def standalone_opened(ctx: ProxyContext, session_id: str, epoch: str) -> None:
    """A standalone GET of the session opened upstream: a re-initialization opens one again."""
    if recording(ctx):
        await _keep(ctx, session_id, epoch, lambda recipe: with_standalone(recipe, True))


async def _keep(
    ctx: ProxyContext,
    session_id: str,
    epoch: str,
    change: Callable[[Recipe], Recipe | None],
    *,
    first: bool = False,
) -> None:
    """Read, change, compare-and-set, again while another writer wins. A session without a recipe (begun
    before the setting, or its initialize unreadable) gets none here: there is nothing to begin again from.
    A store that does not answer costs the recipe, never the request: it is logged."""
    store = ctx.store
    try:
        for _ in range(ATTEMPTS):
            held = None if first else await store.recipe(session_id, epoch)
            if held is None and not first:
                return
            changed = change(Recipe.decode(held) if held is not None else Recipe(params={}))
            if changed is None:
                return
            if await store.keep_recipe(session_id, epoch, held, changed.encode()):
                return
            first = False
    except ProxyError as error:
        log.warning("session %s: its recipe was not kept: %s", log_id(session_id), error.message)
        return
    log.warning(
        "session %s: its recipe was not kept: %d writers in a row came first", log_id(session_id), ATTEMPTS
    )
