"""Short upstream answers, whole in one read, as servers write them and with every oddity next to them:
what ``SSEParser._short`` takes and what it must leave to the general path (a Hypothesis strategy)."""

from __future__ import annotations

from hypothesis import strategies as st

# Event data as MCP upstreams send it: responses (result, error, a JSON escape), notifications in each
# spelling the proxy knows, an answer to the proxy's own request, and data that is no JSON at all.
DATA = [
    b'{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"ok"}],"isError":false}}',
    b'{"jsonrpc":"2.0","id":8,"error":{"code":-32601,"message":"no"}}',
    b'{"jsonrpc":"2.0","id":7,"result":{"text":"caf\\u00e9 \\n line"}}',
    b'{"jsonrpc":"2.0","method":"notifications/progress","params":{"result":1}}',
    b'{"jsonrpc": "2.0", "method": "notifications/message", "params": {"error": 1}}',
    b'{"jsonrpc":"2.0","id":"mcpresume-probe","result":{}}',
    b'{"jsonrpc":"2.0","id":9,"result":{}}',
    b' {"jsonrpc":"2.0","id":7,"result":{}}',
    b'"result"',
    b"plain text",
    b" ",
    b"a\x00b",
]
IDS = [b"1", b"42", b"1_0", b" 7", b"", b"a\x00b", b"e-3"]
EVENTS = [b"message", b"", b"other"]
RETRIES = [b"1000", b"007", b"0", b"1234567890", b"1x", b""]
# Lines that no short answer holds: each sends its chunk down the general path.
ODD_LINES = [b": keep-alive", b"foo: bar", b"data:x", b"id", b"event:message", b"retry: 5", b"data: more"]


@st.composite
def priming(draw: st.DrawFn) -> list[bytes]:
    """The lines of a priming event: an id, an empty data line, a retry before or after it (or none)."""
    lines = [b"id: " + draw(st.sampled_from(IDS)), b"data: "]
    if draw(st.booleans()):
        lines.insert(draw(st.integers(1, 2)), b"retry: " + draw(st.sampled_from(RETRIES)))
    if draw(st.integers(0, 5)) == 0:
        lines.remove(b"data: " if draw(st.booleans()) else lines[0])
    return lines


@st.composite
def message(draw: st.DrawFn) -> list[bytes]:
    """The lines of a message event: an optional id and event line, in either order, then one data line."""
    head = []
    if draw(st.booleans()):
        head.append(b"id: " + draw(st.sampled_from(IDS)))
    if draw(st.booleans()):
        head.append(b"event: " + draw(st.sampled_from(EVENTS)))
    if draw(st.booleans()):
        head.reverse()
    return [*head, b"data: " + draw(st.sampled_from(DATA))]


@st.composite
def short_answers(draw: st.DrawFn) -> bytes:
    """A priming event, a message event or both; now and then an oddity (a line of another kind, a second
    event, CRLF or CR endings, a BOM, a missing blank line, an extra one)."""
    blocks = []
    if draw(st.booleans()):
        blocks.append(draw(priming()))
    if not blocks or draw(st.integers(0, 3)):
        blocks.append(draw(message()))
    if draw(st.integers(0, 3)) == 0:  # a second event
        blocks.insert(draw(st.integers(0, len(blocks))), draw(st.one_of(priming(), message())))
    if draw(st.integers(0, 3)) == 0:
        block = draw(st.sampled_from(blocks))
        block.insert(draw(st.integers(0, len(block))), draw(st.sampled_from(ODD_LINES)))
    body = b"".join(b"".join(line + b"\n" for line in block) + b"\n" for block in blocks)
    oddity = draw(st.integers(0, 14))
    if oddity == 0:
        body = body.replace(b"\n", b"\r\n")
    elif oddity == 1:
        body = body.replace(b"\n", b"\r")
    elif oddity == 2:
        body = b"\xef\xbb\xbf" + body
    elif oddity == 3:
        body = body[: draw(st.integers(0, len(body)))]
    elif oddity == 4:
        body += b"\n"
    return body
