"""The access log: one line per client request, logged when the request ends (``Proxy.handle``, the place
that counts ``mcpresume_requests_total``), also when its handler is cancelled because its client left.

Logger ``mcpresume.access`` at INFO; ``access_log = false`` turns it off. A line's fields (``FIELDS``) are
also attributes of its log record, so ``log_format = json`` writes them as fields of the JSON object. The
session is named by its hash (``process.logs.log_id``), never its id: ids are bearer-like. Nothing is built
for a request when the line is off (the setting, or the logger's level): the hot path pays one check.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

from aiohttp import web

from mcpresume.core.headers import LAST_EVENT_ID_HEADER, SESSION_HEADER
from mcpresume.http.context import ARRIVED, DID, HOPPED_TO, PREPARED, REFUSED, Action
from mcpresume.process.logs import log_id

log = logging.getLogger("mcpresume.access")

# The fields of a line, in the order the text line shows them (absent ones: "-").
FIELDS: Final = (
    "client",  # the client's address (the connection's peer)
    "method",
    "path",  # the path only: a query may carry a token
    "status",  # the status answered; 499: the client left before any answer
    "action",  # what the proxy did: context.Action
    "reason",  # the data.reason of an answer the proxy made itself (an error)
    "session",  # the session's hash (log_id), from the request or the answer beginning it
    "rpc",  # the JSON-RPC method(s) of a POST, comma-separated
    "bytes_in",  # request body bytes received
    "bytes_out",  # the answer's body bytes written (bytes_out)
    "duration_ms",  # from the handler's start to the request's end (a stream's: its end)
    "hop",  # the URL of the replica it was forwarded to (action hopped)
)


class AccessLine:
    """A line's message, formatted only when a handler writes it (a filtered or JSON-only record never is)."""

    __slots__ = ("fields",)

    def __init__(self, fields: Mapping[str, Any]) -> None:
        self.fields = fields

    def __str__(self) -> str:
        f = self.fields
        head = f'{f["client"] or "-"} "{f["method"]} {f["path"]}" {f["status"]} {f["action"]}'
        rest = " ".join(
            f"{name}={f[name]}" for name in FIELDS[5:] if f.get(name) is not None and name != "duration_ms"
        )
        return f"{head} {rest} {f['duration_ms']:.1f}ms" if rest else f"{head} {f['duration_ms']:.1f}ms"


class AccessLog:
    """Writes the access line of a request that ended (``ended``), when on."""

    __slots__ = ("enabled", "mcp_path")

    def __init__(self, enabled: bool, mcp_path: str) -> None:
        self.enabled = enabled
        self.mcp_path = mcp_path

    def ended(
        self,
        request: web.Request,
        status: int,
        response: web.StreamResponse | None,
        methods: tuple[str, ...],
        now: float,
        *,
        want: bool = False,
    ) -> dict[str, Any] | None:
        """The line of ``request``, ended at ``now`` (the loop's clock) with ``status``; ``response``: the
        answer its handler returned (None: it did not return; what it prepared, if anything, is PREPARED).
        Returns its fields, when it is written or ``want`` (the request's span needs them too)."""
        on = self.on()
        if not on and not want:
            return None
        if response is None or response.prepared:  # PREPARED is set: let go of it here (an answer that did
            # not end refers to its request), and the answer's head is known (a cancelled handler's)
            prepared = request.pop(PREPARED, None)
            response = prepared if response is None else response
        fields = self.fields(request, status, response, methods, now)
        if on:
            # Made and handled directly: the logger's search of the caller's frame costs more than the rest.
            log.handle(
                log.makeRecord(
                    log.name, logging.INFO, __file__, 0, AccessLine(fields), (), None, None, fields
                )
            )
        return fields

    def on(self) -> bool:
        """Whether lines are written: the setting, and the logger's level."""
        return self.enabled and log.isEnabledFor(logging.INFO)

    def fields(
        self,
        request: web.Request,
        status: int,
        response: web.StreamResponse | None,
        methods: tuple[str, ...],
        now: float,
    ) -> dict[str, Any]:
        reason = request.get(REFUSED)
        action = request.get(DID)
        if action is None:
            if reason is not None:
                action = Action.REFUSED
            else:
                action = Action.FORWARDED if request.path == self.mcp_path else Action.RELAYED
        session = request.headers.get(SESSION_HEADER)
        if session is None and response is not None:
            session = response.headers.get(SESSION_HEADER)  # the answer that begins a session
        arrived = request.get(ARRIVED)
        return {
            "client": request.remote,
            "method": request.method,
            "path": request.path[:200],
            "status": status,
            "action": action.value,
            "reason": reason,
            "session": None if session is None else log_id(session),
            "rpc": ",".join(methods) if methods else None,
            "bytes_in": request.content.total_bytes,
            "bytes_out": bytes_out(request, response),
            "duration_ms": 0.0 if arrived is None else round((now - arrived) * 1000, 3),
            "hop": request.get(HOPPED_TO),
        }


def bytes_out(request: web.Request, response: web.StreamResponse | None) -> int:
    """The answer's body bytes written to the client. An answer returned whole is written by aiohttp after
    the handler returns (the proxy's own answers, a 202): its body. A streamed one (prepared by its handler,
    which may yet be cancelled): what was written on the connection less its head (aiohttp counts both; a
    chunked body's last chunk, five bytes, is counted too)."""
    if response is not None and not response.prepared:
        body = getattr(response, "body", None)
        return len(body) if isinstance(body, bytes | bytearray) else 0
    written = int(getattr(request.writer, "output_size", 0))
    if not written or response is None:
        return 0  # no head went out: nor did any body
    return max(0, written - _head_bytes(request, response))


def _head_bytes(request: web.Request, response: web.StreamResponse) -> int:
    """The size of a prepared answer's head as aiohttp wrote it: the status line, each header, a CRLF."""
    version = request.version
    size = len(f"HTTP/{version.major}.{version.minor} {response.status} {response.reason}\r\n\r\n")
    for name, value in response.headers.items():
        size += len(name) + len(value) + 4  # "name: value\r\n"
    return size


def span_attributes(request: web.Request, fields: Mapping[str, Any]) -> dict[str, str | int]:
    """What a request's span says once it ended (``process/tracing.py``), from its access line's fields:
    the MCP method(s), the session's hash, what the proxy did, a cursor's outcome, the replica hopped to."""
    attributes: dict[str, str | int] = {
        "http.response.status_code": fields["status"],
        "mcpresume.action": fields["action"],
    }
    if fields["rpc"] is not None:
        attributes["mcp.method.name"] = fields["rpc"]
    if fields["session"] is not None:
        attributes["mcpresume.session"] = fields["session"]
    if fields["reason"] is not None:
        attributes["error.type"] = fields["reason"]
    if fields["hop"] is not None:
        attributes["mcpresume.hop"] = fields["hop"]
    if LAST_EVENT_ID_HEADER in request.headers:  # a resume: re-attached, or the reason it was refused
        outcome = (
            "reattach" if fields["action"] == Action.REATTACHED else fields["reason"] or fields["action"]
        )
        attributes["mcpresume.resume.outcome"] = outcome
    return attributes
