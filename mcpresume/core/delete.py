"""What a DELETE on the MCP endpoint does to the session (pure), once the upstream answered it.

A DELETE is always forwarded (the upstream ends its session; a session the proxy does not track is still
the upstream's to end) and its answer relayed. The executor (``http.delete.serve_delete``) then asks
``plan_delete`` what becomes of the session here, fetches what it says it needs, and asks again. The
rows, first match wins:

====  =============================================  =================================================
row   facts                                          plan
====  =============================================  =================================================
1     no ``Mcp-Session-Id``                          ``Keep``: nothing to end
2     the upstream answered 2xx                      ``Drop`` every incarnation of the session
3     404, the store not asked yet                   ``Need.ACCESS`` (its access record)
4     404, the session known and the request's       ``Drop`` the incarnation checked: the upstream
      credentials accepted in it (``trusted``)       does not know it (it restarted, say)
5     otherwise (404 to credentials not accepted     ``Keep``: an upstream may answer 404 to a session
      in the session, or any other answer)           id of another user
====  =============================================  =================================================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Need(enum.Enum):
    ACCESS = "access"  # the store's access record of the session, and whether the credentials are trusted


@dataclass(frozen=True, slots=True)
class DeleteFacts:
    has_session: bool  # the request carries Mcp-Session-Id
    status: int  # the upstream's answer
    asked: bool = False  # Need.ACCESS was asked ...
    known: bool = False  # ... the store has the session ...
    trusted: bool = False  # ... and the request's credentials are accepted in it


@dataclass(frozen=True, slots=True)
class Keep:
    """The session stays as it is."""


@dataclass(frozen=True, slots=True)
class Drop:
    """Forget the session and stop its pumps: every incarnation (``checked_only`` False), or only the one
    the access record was read in."""

    checked_only: bool


DeletePlan = Keep | Drop


def plan_delete(facts: DeleteFacts) -> DeletePlan | Need:
    """What the DELETE does to the session (the module docstring's table)."""
    if not facts.has_session:
        return Keep()
    if 200 <= facts.status < 300:
        return Drop(checked_only=False)
    if facts.status == 404:
        if not facts.asked:
            return Need.ACCESS
        if facts.known and facts.trusted:
            return Drop(checked_only=True)
    return Keep()
