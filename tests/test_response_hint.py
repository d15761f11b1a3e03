"""The pump's per-chunk response hint is conservative: a chunk that completes a JSON-RPC response is never
hinted "no", however the stream is cut into reads."""

from __future__ import annotations

import itertools

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from mcpresume.pump import ResponseHint
from mcpresume.sse import SSEParser

notification = st.builds(
    lambda n, text: {
        "jsonrpc": "2.0",
        "method": "notifications/progress",
        "params": {"progress": n, "m": text},
    },
    st.integers(0, 99),
    st.text(max_size=40),
)
answer = st.builds(
    lambda key, value, escaped: {"jsonrpc": "2.0", "id": 7, key: value, "_": "\u00e9" if escaped else ""},
    st.sampled_from(["result", "error"]),
    st.dictionaries(st.text(max_size=5), st.integers(-(2**31), 2**31), max_size=3),
    st.booleans(),
)


def frame(message: dict[str, object], escape: bool) -> bytes:
    data = orjson.dumps(message)
    if escape:  # a member name spelled with a JSON escape: still a response
        data = data.replace(b'"result"', b'"res\\u0075lt"').replace(b'"error"', b'"err\\u006fr"')
    return b"event: message\nid: x\ndata: " + data + b"\n\n"


@settings(max_examples=200, deadline=None)
@given(
    messages=st.lists(st.one_of(notification, answer), min_size=1, max_size=12),
    escape=st.booleans(),
    cuts=st.lists(st.integers(0, 2000), max_size=12),
)
def test_every_chunk_completing_a_response_is_hinted(messages, escape, cuts) -> None:
    stream = b"".join(frame(m, escape) for m in messages)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    parser, hint = SSEParser(1 << 20), ResponseHint()
    completed = 0
    for start, end in itertools.pairwise(points):
        chunk = stream[start:end]
        hinted = hint.scan(chunk)
        for event in parser.feed(chunk):
            doc = orjson.loads(event.data)
            if "method" not in doc:
                assert hinted, f"a response completed in an unhinted chunk {chunk!r}"
            completed += 1
    assert completed == len(messages)


def test_a_stream_of_notifications_is_not_hinted() -> None:
    hint = ResponseHint()
    chunk = (
        frame({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}}, False) * 50
    )
    pieces = [chunk[i : i + 100] for i in range(0, len(chunk), 100)]
    assert [hint.scan(piece) for piece in pieces] == [False] * len(pieces)
