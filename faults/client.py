"""A client of the official Python SDK (``mcp``) running tool calls with progress in a loop, its history
recorded (``client-<id>.jsonl``, `faults.history`).

``python -m faults.client --url URL --out FILE --client ID --loops N --stop-file PATH --seed S``: ``N``
session loops at once; each initializes a session and runs ``work`` calls one after another (20-40 steps,
the seed draws how many) until ``PATH`` exists, then ends its call in flight and stops. A call's session
that answered 404 is dropped and a new one initialized, as the spec says. The SDK reconnects and resumes as
it does (GET + ``Last-Event-ID``), with ``--patience`` attempts instead of its 2, so a stream outlives a
fault of a few seconds.

What is recorded beside each call's progress and ending: every JSON-RPC request the transport sent and
every response it passed on (a tap on the transport's streams, so a second response to one id, or one to
an id never sent, is seen though the SDK drops it), and every HTTP answer >= 400 with its ``data.reason``
(an ``httpx`` response hook: the SDK turns a failed re-attach into "reconnection attempts exhausted").
Every request opens its own connection (no keep-alive), so the balancer spreads them all.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import httpx2
import mcp.client.streamable_http as sdk_transport
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._stream_protocols import ReadStream, WriteStream
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from mcp_types import JSONRPCError, JSONRPCRequest, JSONRPCResponse

from faults.history import JsonLines

DELAY = 0.1  # seconds between progress steps: a call of 20-40 steps lasts 2-4 s
INIT_TIMEOUT = 20.0
ERROR_PAUSE = 0.5  # after a call's error, before the next call: a client does not hammer a failing server


@dataclass
class LoopState:
    """What one session loop is doing, for the HTTP hook."""

    conn: str
    sid: str | None = None
    tag: str | None = None
    gone: bool = False


class Recorder:
    def __init__(self, path: Path, client: str) -> None:
        self.log = JsonLines(path)
        self.client = client

    def __call__(self, ev: str, **fields: Any) -> None:
        self.log.write(ev, client=self.client, **fields)


class TapRead:
    """The transport's read stream, recording every response (or error) that passes."""

    def __init__(self, inner: ReadStream[SessionMessage | Exception], record: Recorder, state: LoopState):
        self.inner, self.record, self.state = inner, record, state

    @property
    def last_context(self) -> Any:
        return getattr(self.inner, "last_context", None)

    def _tap(self, item: SessionMessage | Exception) -> SessionMessage | Exception:
        if isinstance(item, SessionMessage) and isinstance(item.message, JSONRPCResponse | JSONRPCError):
            kind = "error" if isinstance(item.message, JSONRPCError) else "result"
            self.record("response", conn=self.state.conn, rid=item.message.id, kind=kind, sid=self.state.sid)
        return item

    async def receive(self) -> SessionMessage | Exception:
        return self._tap(await self.inner.receive())

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __aiter__(self) -> TapRead:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    async def __aenter__(self) -> TapRead:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        await self.aclose()
        return None


class TapWrite:
    """The transport's write stream, recording every request sent."""

    def __init__(self, inner: WriteStream[SessionMessage], record: Recorder, state: LoopState) -> None:
        self.inner, self.record, self.state = inner, record, state

    async def send(self, item: SessionMessage, /) -> None:
        message = item.message
        if isinstance(message, JSONRPCRequest):
            arguments = (message.params or {}).get("arguments") or {}
            tag = arguments.get("tag") if isinstance(arguments, dict) else None
            self.record("sent", conn=self.state.conn, rid=message.id, method=message.method, tag=tag)
        await self.inner.send(item)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> TapWrite:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        await self.aclose()
        return None


def _reason(body: bytes) -> str | None:
    try:
        data = json.loads(body)["error"]["data"]
        return str(data["reason"]) if isinstance(data, dict) and "reason" in data else None
    except (ValueError, KeyError, TypeError):
        return None


def http_client(record: Recorder, state: LoopState) -> httpx2.AsyncClient:
    async def on_response(response: httpx2.Response) -> None:
        sid = response.headers.get("mcp-session-id")
        if sid and state.sid is None:
            state.sid = sid
        if response.status_code < 400:
            return
        await response.aread()
        asked = response.request.headers.get("mcp-session-id")
        reason = _reason(response.content)
        unexplained = {} if reason else {"body": response.content[:200].decode(errors="replace")}
        record(
            "http",
            conn=state.conn,
            method=response.request.method,
            status=response.status_code,
            reason=reason,
            sid=asked,
            tag=state.tag,
            **unexplained,
        )
        if response.status_code == 404 and asked:
            state.gone = True

    return httpx2.AsyncClient(
        timeout=httpx2.Timeout(30.0, read=60.0),
        limits=httpx2.Limits(max_keepalive_connections=0),
        event_hooks={"response": [on_response]},
    )


async def call(
    session: ClientSession, record: Recorder, state: LoopState, tag: str, steps: int, deadline: float
) -> bool:
    """One call of ``work``; whether it got its result."""
    state.tag = tag
    record("call", conn=state.conn, tag=tag, sid=state.sid, steps=steps)

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        record("progress", tag=tag, p=progress)

    try:
        with anyio.fail_after(deadline):
            arguments: dict[str, Any] = {"tag": tag, "steps": steps, "delay": DELAY}
            result = await session.call_tool("work", arguments, progress_callback=on_progress)
        text = getattr(result.content[0], "text", None) if result.content else None
        if result.is_error:
            record("error", tag=tag, code=None, message=f"tool error: {text}", reason=None)
            return False
        record("result", tag=tag, text=text)
        return True
    except TimeoutError:
        record("timeout", tag=tag)
        state.gone = True  # a session whose call hung is not trusted further: start another
    except MCPError as exc:
        data = exc.data if isinstance(exc.data, dict) else {}
        record("error", tag=tag, code=exc.code, message=exc.message, reason=data.get("reason"))
    except Exception as exc:
        record("error", tag=tag, code=None, message=repr(exc)[:300], reason=None)
    except BaseException as exc:  # the SDK tore the whole session down (a request's connection broke)
        record("error", tag=tag, code=None, message=f"the session ended: {exc!r}"[:300], reason=None)
        raise
    finally:
        state.tag = None
    return False


@dataclass(frozen=True)
class Stop:
    file: Path
    at: float  # a bound of its own, should nobody ever write the file

    def __call__(self) -> bool:
        return self.file.exists() or time.time() > self.at


async def session_loop(
    record: Recorder, url: str, loop: int, stop: Stop, rng: random.Random, deadline: float
) -> None:
    sessions = 0
    calls = 0
    while not stop():
        state = LoopState(conn=f"{loop}.{sessions}")
        sessions += 1
        try:
            async with (
                http_client(record, state) as http,
                streamable_http_client(url, http_client=http, terminate_on_close=False) as (read, write),
                ClientSession(TapRead(read, record, state), TapWrite(write, record, state)) as session,
            ):
                with anyio.fail_after(INIT_TIMEOUT):
                    await session.initialize()
                    # The SDK checks a result against the tool's schema, listing the tools first if it has
                    # not yet: once here, not after every call's result.
                    await session.list_tools()
                record("session", conn=state.conn, sid=state.sid)
                while not stop() and not state.gone:
                    calls += 1
                    tag = f"{record.client}-{loop}-{calls}"
                    if not await call(session, record, state, tag, rng.randint(20, 40), deadline):
                        await anyio.sleep(ERROR_PAUSE)
        except Exception as exc:
            record("init_error", conn=state.conn, message=repr(exc)[:300])
            await anyio.sleep(0.5)


async def run(args: argparse.Namespace) -> None:
    sdk_transport.MAX_RECONNECTION_ATTEMPTS = args.patience  # the module reads it at each reconnect
    record = Recorder(args.out, args.client)
    record("client", sdk="python")
    async with anyio.create_task_group() as group:
        for loop in range(args.loops):
            rng = random.Random(f"{args.seed}:{args.client}:{loop}")
            stop = Stop(args.stop_file, time.time() + args.max_seconds)
            group.start_soon(session_loop, record, args.url, loop, stop, rng, args.deadline)
    record("done")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m faults.client", description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--client", required=True)
    parser.add_argument("--loops", type=int, default=2)
    parser.add_argument("--stop-file", type=Path, required=True)
    parser.add_argument("--max-seconds", type=float, default=7200.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=30.0)
    parser.add_argument("--patience", type=int, default=8)
    args = parser.parse_args(argv)
    anyio.run(run, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
