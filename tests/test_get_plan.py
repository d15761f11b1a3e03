"""What a GET on the MCP endpoint gets (``mcpresume.core.get``): its two tables, row by row, without sockets.

The handler that carries the plans out (``http.get.Gets.serve``) is tested over real HTTP in
``tests/test_resume_http.py``, ``tests/test_streams.py`` and ``tests/test_authorization.py``.
"""

from __future__ import annotations

import pytest

from mcpresume.core.errors import CursorOutOfWindow, SessionGone, UnknownSession
from mcpresume.core.get import (
    GetFacts,
    Join,
    Need,
    Open,
    Reject,
    Relay,
    Resumed,
    ServeWindow,
    Standalone,
    WaitForOpening,
    plan_get,
    plan_standalone,
)
from mcpresume.core.resume import ReAttach, SessionView, StreamView

EPOCH = "aaaabbbbcccc"
OUT_OF_WINDOW = CursorOutOfWindow("events after the cursor were evicted from the window")


def _stream(*, standalone: bool = False, live: bool = True, group: tuple[int, ...] = ()) -> StreamView:
    return StreamView(3, live, 10, 20, 0, standalone, group)


def _resumed(stream: StreamView, after: int) -> Resumed:
    return Resumed(ReAttach(stream.number, after), stream, newest=25)


# (facts, plan): the module docstring's first table, a row (or more) each.
GET_ROWS = [
    # 1. relayed as it is
    (GetFacts(has_session=False, stateless=False, has_cursor=False), Relay()),
    (GetFacts(has_session=False, stateless=False, has_cursor=True), Relay()),
    (GetFacts(has_session=True, stateless=True, has_cursor=True), Relay()),
    # 2. the store first
    (GetFacts(has_session=True, stateless=False, has_cursor=False), Need.ACCESS),
    (GetFacts(has_session=True, stateless=False, has_cursor=True), Need.ACCESS),
    # 3. a cursor: the resume decision, known session or not (decide answers 404 for an unknown one)
    (GetFacts(True, False, True, asked=True, known=True), Need.RESUME),
    (GetFacts(True, False, True, asked=True, known=False), Need.RESUME),
    # 4. its rejection
    (GetFacts(True, False, True, asked=True, known=True, resumed=OUT_OF_WINDOW), Reject(OUT_OF_WINDOW)),
    # 5. the end of an ended standalone stream: a new one
    (
        GetFacts(True, False, True, True, True, _resumed(_stream(standalone=True, live=False), 20)),
        Standalone(replaces=3),
    ),
    # 6. a re-attach: a view from the window, its group with it
    (
        GetFacts(True, False, True, True, True, _resumed(_stream(standalone=True, live=False), 19)),
        ServeWindow((3,), 19, 25, standalone=True),
    ),
    (
        GetFacts(True, False, True, True, True, _resumed(_stream(standalone=True), 20)),
        ServeWindow((3,), 20, 25, standalone=True),  # live: more comes
    ),
    (
        GetFacts(True, False, True, True, True, _resumed(_stream(live=False, group=(4, 5)), 20)),
        ServeWindow((3, 4, 5), 20, 25, standalone=False),  # a POST stream's end is sent as it is
    ),
    # 7. no cursor, the session unknown: 404
    (GetFacts(True, False, False, asked=True, known=False), Reject(UnknownSession())),
    # 8. no cursor: the standalone stream
    (GetFacts(True, False, False, asked=True, known=True), Standalone()),
]


def _same(got: object, expected: object) -> bool:
    """Plans compare by value; a rejection by its error's class, reason and message."""
    if isinstance(got, Reject) and isinstance(expected, Reject):
        return type(got.error) is type(expected.error) and str(got.error) == str(expected.error)
    return got == expected


@pytest.mark.parametrize(("facts", "expected"), GET_ROWS)
def test_a_get_is_planned_by_its_table(facts: GetFacts, expected: object) -> None:
    assert _same(plan_get(facts), expected)


def test_every_plan_of_a_get_has_a_row() -> None:
    kinds = {type(expected) for _, expected in GET_ROWS}
    assert kinds == {Relay, Reject, ServeWindow, Standalone, Need}
    assert {expected for _, expected in GET_ROWS if isinstance(expected, Need)} == set(Need)


def _view(epoch: str = EPOCH, head: int = 20, first: int = 10, retained: bool = True) -> SessionView:
    stream = StreamView(7, True, first, head, 0, standalone=True) if retained else None
    return SessionView(epoch, None, 8, head, (7, first), (7, head), stream)


# (live, view, opening, primes, plan): the module docstring's second table.
STANDALONE_ROWS = [
    # 1. re-issued since the credentials were checked
    (7, _view(epoch="zzzzyyyyxxxx"), False, True, Reject(UnknownSession(SessionGone.ENDED_WHILE_JOINING))),
    # 2. joined at its head, primed when the client takes priming events and the head is an event
    (7, _view(), False, True, Join(7, 20, primed=True)),
    (7, _view(), True, True, Join(7, 20, primed=True)),  # opened already: joined, no wait
    (7, _view(), False, False, Join(7, 20, primed=False)),
    (7, _view(head=9, first=10), False, True, Join(7, 9, primed=False)),  # unprimed, no event yet
    # 3. being opened by another request of the session: wait, then look again
    (None, None, True, True, WaitForOpening()),
    (7, None, True, True, WaitForOpening()),  # the store lost it meanwhile
    (7, _view(retained=False), True, True, WaitForOpening()),
    # 4. open it
    (None, None, False, True, Open()),
    (7, _view(retained=False), False, True, Open()),
]


@pytest.mark.parametrize(("live", "view", "opening", "primes", "expected"), STANDALONE_ROWS)
def test_a_standalone_get_is_planned_by_its_table(
    live: int | None, view: SessionView | None, opening: bool, primes: bool, expected: object
) -> None:
    assert _same(plan_standalone(live, view, EPOCH, opening=opening, primes=primes), expected)


def test_every_plan_of_a_standalone_get_has_a_row() -> None:
    assert {type(row[-1]) for row in STANDALONE_ROWS} == {Reject, Join, WaitForOpening, Open}
