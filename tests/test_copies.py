"""``store/copies.py``: which of this process's appends a read may be answered from, without Redis."""

from __future__ import annotations

import time
from array import array

from mcpresume.core.session import READ_MAX_EVENTS
from mcpresume.store.copies import FRESH, RECENT, Copies, LastAppend

SID = "s"


def append(copies: Copies, first: int, count: int, version: int, stream: int = 1, **extra: object) -> None:
    field = f"f{first}".encode()
    bodies = [b"e%d;" % seq for seq in range(first, first + count)]
    copies.bodies.put(field, b"".join(bodies))
    lengths = array("I", map(len, bodies))
    copy = LastAppend(first, stream, lengths, field, 0.0, sum(lengths), version, **extra)  # type: ignore[arg-type]
    copies.appended(SID, copy)


def seqs(
    copies: Copies, after: int, most: int = READ_MAX_EVENTS, streams: tuple[int, ...] = (1,)
) -> list[int] | None:
    result = copies.read(SID, streams, after, most, 1 << 20)
    return None if result is None else [e.seq for e in result.events]


def test_consecutive_appends_answer_a_read_from_anywhere_within_them() -> None:
    copies = Copies()
    copies.epochs[SID] = b"epoch"
    append(copies, 2, 1, version=5)
    append(copies, 3, 2, version=6)
    append(copies, 5, 3, version=7)
    assert seqs(copies, 1) == [2, 3, 4, 5, 6, 7]
    assert seqs(copies, 3) == [4, 5, 6, 7]
    assert seqs(copies, 3, most=2) == [4, 5]
    result = copies.read(SID, (1,), 3, 2, 1 << 20)
    assert result is not None and result.more and result.version == 7
    assert seqs(copies, 0) is None  # before the first of them: Redis
    assert seqs(copies, 7) is None  # nothing after it here: Redis (or the wait)
    assert seqs(copies, 1, streams=(2,)) is None  # another stream's reader


def test_a_change_in_between_starts_the_run_again() -> None:
    copies = Copies()
    copies.epochs[SID] = b"epoch"
    append(copies, 2, 1, version=5)
    append(copies, 3, 1, version=7)  # version 6 was someone else's change
    assert seqs(copies, 1) is None and seqs(copies, 2) == [3]
    append(copies, 5, 1, version=8)  # seq 4 is another's event
    assert seqs(copies, 3) is None and seqs(copies, 4) == [5]
    append(copies, 6, 1, version=9, stream=2)  # another stream of the session
    assert seqs(copies, 4, streams=(1, 2)) is None and seqs(copies, 5, streams=(2,)) == [6]
    copies.changed(SID)
    assert seqs(copies, 5, streams=(2,)) is None


def test_at_most_recent_appends_and_only_fresh_ones_are_kept() -> None:
    copies = Copies()
    copies.epochs[SID] = b"epoch"
    for i in range(RECENT + 2):
        append(copies, 2 + i, 1, version=10 + i)
    assert seqs(copies, 2) is None and seqs(copies, 3) == list(range(4, 2 + RECENT + 2))  # the last RECENT
    copies = Copies()
    copies.epochs[SID] = b"epoch"
    stale = time.monotonic() - FRESH - 1
    append(copies, 2, 1, version=5, made=stale)
    append(copies, 3, 1, version=6)
    assert seqs(copies, 1) is None  # its first append is too old to stand for Redis
    assert seqs(copies, 2) == [3]


def test_a_reader_behind_what_its_stream_had_evicted_asks_redis() -> None:
    copies = Copies()
    copies.epochs[SID] = b"epoch"
    append(copies, 2, 2, version=5)
    append(copies, 4, 2, version=6, evicted_through=2)
    assert seqs(copies, 1) is None
    assert seqs(copies, 2) == [3, 4, 5]


def test_a_read_takes_what_a_read_from_redis_would_by_bytes_too() -> None:
    """Over ``max_bytes`` a read stops where Redis's would: a whole append only if it fits (or is one
    event), else event by event, at least one."""
    copies = Copies()
    copies.epochs[SID] = b"epoch"
    append(copies, 2, 3, version=5)  # three events of 3 bytes
    result = copies.read(SID, (1,), 1, READ_MAX_EVENTS, 4)
    assert result is not None and [e.seq for e in result.events] == [2] and result.more
    result = copies.read(SID, (1,), 1, READ_MAX_EVENTS, 6)
    assert result is not None and [e.seq for e in result.events] == [2, 3] and result.more


def test_an_append_that_ended_its_stream_answers_a_read_complete() -> None:
    """``append_and_end``: two changes of the version (the append, the end); a read that takes all of it,
    of that stream alone, is complete; a read of more streams (did the others end?) or one cut short by its
    limits is not answered complete."""
    copies = Copies()
    copies.epochs[SID] = b"epoch"
    append(copies, 2, 1, version=5)  # the stream's priming event (its opening)
    append(copies, 3, 2, version=7, ended=True)
    result = copies.read(SID, (1,), 1, READ_MAX_EVENTS, 1 << 20)
    assert result is not None and result.complete and result.version == 7
    assert [e.seq for e in result.events] == [2, 3, 4]
    cut = copies.read(SID, (1,), 1, 2, 1 << 20)
    assert cut is not None and cut.more and not cut.complete
    assert seqs(copies, 1, streams=(1, 2)) is None
    copies.changed(SID)
    append(copies, 5, 1, version=8)
    append(copies, 6, 1, version=9, ended=True)  # version 9 is not 8 + 2: someone else's change in between
    assert seqs(copies, 4) is None and seqs(copies, 5) == [6]
