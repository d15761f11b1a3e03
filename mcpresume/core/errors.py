"""The one exception tree of mcpresume (pure: no I/O, no framework imports).

Every error the proxy answers with carries the HTTP status it suggests and a stable, machine-readable
``reason``. The reason is the contract with clients and operators: it appears in the JSON-RPC error body
(``error.data.reason``), in the one log line, and as a metric label. Messages may change; reasons do not.

Library errors (aiohttp, redis) are wrapped into this tree at the shell's boundary, so the core and the
handlers only ever deal with ``ProxyError``.
"""

from __future__ import annotations

import enum
from typing import Any

# JSON-RPC 2.0 reserves -32000..-32099 for implementation-defined server errors; the MCP SDKs use -32000
# for transport-level failures, so clients already treat it as "the transport said no".
SERVER_ERROR = -32000
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602


class ProxyError(Exception):
    """Base of every error the proxy turns into an HTTP answer."""

    status: int = 500
    reason: str = "internal_error"
    code: int = SERVER_ERROR

    def __init__(self, message: str, **facts: Any) -> None:
        super().__init__(message)
        self.message = message
        self.facts: dict[str, Any] = facts

    def data(self) -> dict[str, Any]:
        """The JSON-RPC ``error.data`` object: the reason first, then the facts."""
        return {"reason": self.reason, **self.facts}


# -- session and cursor (the resume decision's rejections) -------------------------------------------------


@enum.unique  # a cause whose message repeats another's would be an alias of it, not a cause
class SessionGone(enum.Enum):
    """Why the proxy answers 404 ``unknown_session``, each with its message: the one way to say it."""

    UNTRACKED = "session is unknown, deleted or expired; re-initialize"  # never tracked, reaped, deleted
    # Tracked when the request came, ended (DELETE, reaped, its id re-issued) before its answer was kept:
    ENDED_WHILE_FORWARDED = "the session ended while its request was forwarded; re-initialize"
    ENDED_WHILE_JOINING = "the session ended while its standalone stream was joined; re-initialize"
    ENDED_WHILE_OPENING = "the session ended while its standalone stream was opened; re-initialize"
    # The upstream answered 404 in the session to credentials it accepted there (http/credentials.py).
    UPSTREAM_FORGOT = "the upstream does not know this session (for these credentials); re-initialize"


class UnknownSession(ProxyError):
    """404: the session is unknown, deleted or expired. The client MUST start a new session (spec)."""

    status = 404
    reason = "unknown_session"

    def __init__(self, cause: SessionGone = SessionGone.UNTRACKED) -> None:
        super().__init__(cause.value)
        self.cause = cause


class UpstreamSessionLost(UnknownSession):
    """404: the upstream answered 404 in a session the proxy tracks, to credentials it accepted there: it lost
    the session (it restarted, crashed, or its pod was lost). Under ``upstream_session_lost = "end"`` the
    proxy ends the session and says why with its own 404 (never the upstream's body); the client
    re-initializes as for any 404. An ``UnknownSession`` (invariant #10: 404 means only "the session is
    gone"), its reason telling the client and the operator that the upstream, not the client, lost it."""

    reason = "upstream_session_lost"

    def __init__(self, **facts: Any) -> None:
        super().__init__(SessionGone.UPSTREAM_FORGOT)
        self.facts.update(facts)  # under "reinitialize": why it was not begun again (``outcome``)


class UnknownTask(ProxyError):
    """404: a task the proxy made (``core/tasks.py``) is unknown, expired, or another credential's. The
    tasks extension's code for a task not found: invalid params."""

    status = 404
    reason = "unknown_task"
    code = INVALID_PARAMS

    def __init__(self) -> None:
        super().__init__("the task is unknown or expired")


class InvalidTaskParams(ProxyError):
    """400: a ``tasks/*`` request whose params the proxy cannot take: no ``taskId`` string (or one over
    ``core.tasks.MAX_TASK_ID_LEN``), an ``Mcp-Name`` header that names another task, a ``tasks/update``
    without an ``inputResponses`` object. ``problem``: which."""

    status = 400
    reason = "invalid_task_params"
    code = INVALID_PARAMS

    def __init__(self, problem: str) -> None:
        super().__init__(f"invalid tasks request: {problem}", problem=problem)


class TaskOutOfTurn(ProxyError):
    """400: a ``tasks/*`` its task's status does not allow (``core/tasks.py``'s table); ``status``: the
    task's, or ``changed`` when it moved on while the request was taken. The task is left as it is."""

    status = 400
    code = INVALID_PARAMS
    said = "the task's status does not allow it"

    def __init__(self, status: str) -> None:
        super().__init__(self.said, status=status)


class TaskNotWaiting(TaskOutOfTurn):
    """A ``tasks/update`` for a task that is not waiting for input (``input_required``)."""

    reason = "task_not_waiting"
    said = "the task is not waiting for input"


class TaskFinished(TaskOutOfTurn):
    """A ``tasks/cancel`` for a task already ``completed``, ``failed`` or ``cancelled`` (a terminal status
    is final)."""

    reason = "task_finished"
    said = "the task has already finished"


class MalformedCursor(ProxyError):
    """400: a ``Last-Event-ID`` the proxy did not issue."""

    status = 400
    reason = "malformed_cursor"


class ForeignCursor(ProxyError):
    """409: a well-formed cursor of another session, or of an earlier epoch of this session id."""

    status = 409
    reason = "foreign_cursor"


class CursorOutOfWindow(ProxyError):
    """409: an event after the cursor was evicted; re-attaching would leave a silent gap."""

    status = 409
    reason = "cursor_out_of_window"


class CursorAhead(ProxyError):
    """409: the cursor names a position the session has not reached."""

    status = 409
    reason = "cursor_ahead"


class DuplicateRequest(ProxyError):
    """409: a request id already seen in this session, which cannot be attached to its original stream."""

    status = 409
    reason = "duplicate_request"


class RequestCancelled(ProxyError):
    """409: a request id the client cancelled (``notifications/cancelled``) in this session: it reached the
    upstream once and is never forwarded again, and no answer of it is kept (the spec: a cancelled request
    SHOULD NOT be answered)."""

    status = 409
    reason = "request_cancelled"


class OutcomeUnknown(ProxyError):
    """409: a re-sent request whose first sending reached the upstream and got no answer (its head did not
    come within ``first_byte_timeout``, or the connection broke): it may have run, so it is never sent
    again, and what it did is unknown."""

    status = 409
    reason = "outcome_unknown"


class RequestIdInUse(ProxyError):
    """409: another request under a request id whose request in the session is not over yet (in flight, its
    outcome unknown, or its stream still live): not forwarded, since the upstream could not tell their
    answers apart. Over, the id may carry another request."""

    status = 409
    reason = "request_id_in_use"


class CredentialsRefused(ProxyError):
    """The upstream did not accept the request's credentials for this session (asked with a ``ping``):
    nothing of the session is served. Its status is the upstream's 4xx (401 or 403, as a rule), else 403
    (a 2xx or 3xx without the ping's result)."""

    status = 403
    reason = "credentials_refused"

    def __init__(self, message: str, status: int = 403, challenges: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.challenges = challenges  # the upstream's WWW-Authenticate values, relayed as they came


# -- limits ----------------------------------------------------------------------------------------------


class TooManySessions(ProxyError):
    """503: ``max_sessions`` is reached; no active session is ever evicted to make room."""

    status = 503
    reason = "too_many_sessions"


class StoreUnavailable(ProxyError):
    """503: the shared session store (Redis) did not answer in time, or refused; the client retries."""

    status = 503
    reason = "store_unavailable"


class TooManyConnections(ProxyError):
    """503: the listener holds ``max_connections`` client connections (answered before any request)."""

    status = 503
    reason = "too_many_connections"


class BodyTooLarge(ProxyError):
    """413: a client request body over ``max_body_bytes``."""

    status = 413
    reason = "body_too_large"


class TooManyAttachments(ProxyError):
    """429: a session already has ``max_attached_per_session`` client views open."""

    status = 429
    reason = "too_many_attachments"


class TooManyStreams(ProxyError):
    """429: a session already has ``max_streams_per_session`` live streams."""

    status = 429
    reason = "too_many_streams"


class HeadersTooLarge(ProxyError):
    """431: request headers over ``max_header_bytes``."""

    status = 431
    reason = "headers_too_large"


class BodyTimeout(ProxyError):
    """408: a request body that did not arrive within ``body_timeout`` (slowloris)."""

    status = 408
    reason = "body_timeout"


class OriginNotAllowed(ProxyError):
    """403: a present ``Origin`` not in ``allowed_origins`` (the spec's DNS-rebinding MUST)."""

    status = 403
    reason = "origin_not_allowed"


class HostNotAllowed(ProxyError):
    """403: a ``Host`` not in ``allowed_hosts``."""

    status = 403
    reason = "host_not_allowed"


class BadRequest(ProxyError):
    """400: a request the proxy cannot interpret (not JSON, not JSON-RPC, a bad header value)."""

    status = 400
    code = INVALID_REQUEST
    reason = "bad_request"


class BadSessionId(BadRequest):
    """400: an ``Mcp-Session-Id`` that is not 1-``MAX_SESSION_ID_LEN`` (``core/headers.py``: 2,048) visible
    ASCII characters (spec: 0x21-0x7E)."""

    code = SERVER_ERROR
    reason = "bad_session_id"


class InvalidJson(BadRequest):
    code = PARSE_ERROR
    reason = "invalid_json"


class EventTooLarge(ProxyError):
    """An upstream SSE line or event over ``max_event_bytes``: the stream is failed, never buffered on."""

    status = 502
    reason = "event_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"upstream SSE event exceeds {limit} bytes", limit=limit)
        self.limit = limit


# -- upstream ---------------------------------------------------------------------------------------------


class UpstreamUnreachable(ProxyError):
    """502: the upstream could not be reached, or its connection broke before its answer's head.
    ``unsent``: the request is known never to have been sent (no connection to the upstream was made);
    otherwise it may have been, and may have run (``core.post.CLAIM_ENDS``)."""

    status = 502
    reason = "upstream_unreachable"

    def __init__(self, message: str, *, unsent: bool = False, **facts: Any) -> None:
        super().__init__(message, **facts)
        self.unsent = unsent


class UpstreamTimeout(ProxyError):
    """504: the upstream's answer head did not come within ``first_byte_timeout`` (the request may have been
    sent, and may have run)."""

    status = 504
    reason = "upstream_timeout"


class UpstreamBadResponse(ProxyError):
    """502: an upstream answer the proxy cannot use: a JSON-RPC request answered with a content type the
    protocol does not allow, or the proxy's credential ping answered with a server error."""

    status = 502
    reason = "upstream_bad_response"


class UpstreamStreamLost(ProxyError):
    """The upstream stream ended before the JSON-RPC response of its request and could not be resumed. Never
    an HTTP answer (the stream's 200 went out long before): each request its stream left unanswered gets it
    as its JSON-RPC error, in the stream (``core.pump.UpstreamEvents.unanswered``)."""

    status = 502
    reason = "upstream_stream_lost"


class UpstreamBadSessionId(ProxyError):
    """502: an ``initialize`` the upstream answered with an ``Mcp-Session-Id`` the proxy cannot carry (over
    ``MAX_SESSION_ID_LEN`` characters, or not visible ASCII): every request of the session would be 400
    ``bad_session_id``, so none is begun (the upstream is asked to end its own with a DELETE)."""

    status = 502
    reason = "upstream_bad_session_id"


# -- several replicas (owner routing) ----------------------------------------------------------------------


class OwnerUnreachable(ProxyError):
    """502: the request was forwarded to the replica that owns its session, which could not be reached
    (or did not answer its head in time)."""

    status = 502
    reason = "owner_unreachable"


class MisroutedHop(ProxyError):
    """503: a request forwarded by another replica (it carries the hop header) reached a replica that
    does not own its session: ownership moved on the way. Never forwarded a second time."""

    status = 503
    reason = "misrouted_hop"


class OwnerLost(ProxyError):
    """503: the session's owner has no live lease, and its takeover left no live owner to serve it."""

    status = 503
    reason = "owner_lost"


class ShuttingDown(ProxyError):
    status = 503
    reason = "shutting_down"


def jsonrpc_error_body(error: ProxyError, request_id: Any = None) -> dict[str, Any]:
    """The JSON-RPC 2.0 error object every proxy 4xx/5xx carries."""
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "error": {"code": error.code, "message": error.message, "data": error.data()},
    }
