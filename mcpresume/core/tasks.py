"""Durable long calls: when a 2026-07-28 ``tools/call`` becomes a task the proxy keeps, and a task's life.

Theory of operation
-------------------
In revision 2026-07-28 a closed response stream cancels its request; work that must outlive a connection
uses the tasks extension (``io.modelcontextprotocol/tasks``). A server may answer a ``tools/call`` with a
``CreateTaskResult`` (``resultType: "task"``) only when the client declared the extension in *that*
request's capabilities, and must not before the task is durably created. The proxy does this for an
upstream that has no tasks: it forwards the call without the extension (``upstream_params``), and when the
answer has not ended within ``task_after`` it stores a ``Task`` and answers the client its handle; it keeps
reading the upstream's answer, and what that answer is (``classify``) moves the task on.

``plan_call`` decides whether a call may become a task at all (``Eligibility``). ``STEPS`` is a task's
lifecycle, one row per (status, event); a pair not in the table is refused (``step`` returns ``REFUSED``):

===================  ==================  =================
status               event               next status
===================  ==================  =================
working              ANSWERED            completed
working              FAILED              failed
working              CANCEL              cancelled
working              INPUT_REQUIRED      input_required
input_required       UPDATE              working
input_required       CANCEL              cancelled
input_required       FAILED              failed
(any)                EXPIRE              (the task is gone)
===================  ==================  =================

``completed``, ``failed`` and ``cancelled`` are terminal: every event but EXPIRE is refused there (a cancel
of a finished task changes nothing; a late answer of a cancelled one is dropped). A task expires
``task_ttl`` seconds after its creation, whatever its status (``expired``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Final

import orjson

TASKS_EXTENSION: Final = "io.modelcontextprotocol/tasks"
CAPABILITIES_META: Final = "io.modelcontextprotocol/clientCapabilities"
TOOLS_CALL: Final = "tools/call"
TASKS_GET: Final = "tasks/get"
TASKS_UPDATE: Final = "tasks/update"
TASKS_CANCEL: Final = "tasks/cancel"
TASK_METHODS: Final = frozenset({TASKS_GET, TASKS_UPDATE, TASKS_CANCEL})

# Task ids are bearer-like (a task of another token is 404, but an id must not be guessable either):
# 32 bytes of the system's CSPRNG, url-safe base64 (43 characters). Longer ids than this are refused
# before any store lookup.
TASK_ID_BYTES: Final = 32
TASK_ID_PREFIX: Final = "mcpr-"  # the proxy's own task ids; any other id is the upstream's, passed on
MAX_TASK_ID_LEN: Final = 128
MAX_STATUS_MESSAGE: Final = 1024  # a progress message kept with a task, at most (it is polled often)


class Status(Enum):
    WORKING = "working"
    INPUT_REQUIRED = "input_required"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL: Final = frozenset({Status.COMPLETED, Status.FAILED, Status.CANCELLED})


class Event(Enum):
    ANSWERED = "answered"  # the upstream's answer ended with a result
    FAILED = "failed"  # an upstream error, or its answer lost
    CANCEL = "cancel"  # the client's tasks/cancel
    INPUT_REQUIRED = "input_required"  # the upstream answered an InputRequiredResult (MRTR)
    UPDATE = "update"  # the client's tasks/update with the input responses
    EXPIRE = "expire"  # task_ttl passed


class Refused(Enum):
    REFUSED = "refused"


REFUSED: Final = Refused.REFUSED


class Gone(Enum):
    GONE = "gone"


GONE: Final = Gone.GONE

STEPS: Final[dict[tuple[Status, Event], Status]] = {
    (Status.WORKING, Event.ANSWERED): Status.COMPLETED,
    (Status.WORKING, Event.FAILED): Status.FAILED,
    (Status.WORKING, Event.CANCEL): Status.CANCELLED,
    (Status.WORKING, Event.INPUT_REQUIRED): Status.INPUT_REQUIRED,
    (Status.INPUT_REQUIRED, Event.UPDATE): Status.WORKING,
    (Status.INPUT_REQUIRED, Event.CANCEL): Status.CANCELLED,
    (Status.INPUT_REQUIRED, Event.FAILED): Status.FAILED,
}


def step(status: Status, event: Event) -> Status | Refused | Gone:
    """The status after ``event``: total over every pair (``STEPS``, EXPIRE, else ``REFUSED``)."""
    if event is Event.EXPIRE:
        return GONE
    return STEPS.get((status, event), REFUSED)


# -- which calls become tasks ------------------------------------------------------------------------


class Eligibility(Enum):
    TASK = "task"  # forward without the extension; a task if the answer outlasts task_after
    AS_TODAY = "as_today"  # passed through as it came


def declares_tasks(params: Any) -> bool:
    """Whether a request's per-request capabilities (``params._meta``) declare the tasks extension."""
    if not isinstance(params, dict):
        return False
    meta = params.get("_meta")
    caps = meta.get(CAPABILITIES_META) if isinstance(meta, dict) else None
    extensions = caps.get("extensions") if isinstance(caps, dict) else None
    return isinstance(extensions, dict) and TASKS_EXTENSION in extensions


def plan_call(doc: Any, *, enabled: bool, modern: bool) -> Eligibility:
    """A client's message: a single 2026-07-28 ``tools/call`` request that declared the extension may
    become a task; anything else (a batch, a notification, another method, the handshake era, the
    feature off) goes as today."""
    if not (enabled and modern and isinstance(doc, dict)):
        return Eligibility.AS_TODAY
    if doc.get("method") != TOOLS_CALL or "id" not in doc or not declares_tasks(doc.get("params")):
        return Eligibility.AS_TODAY
    return Eligibility.TASK


def upstream_params(params: dict[str, Any]) -> dict[str, Any]:
    """The call's params as the upstream gets them: the tasks extension taken out of its capabilities
    (so the upstream answers the call itself; the proxy makes the task). Nothing else changes."""
    meta = dict(params["_meta"])
    caps = dict(meta[CAPABILITIES_META])
    extensions = {k: v for k, v in caps["extensions"].items() if k != TASKS_EXTENSION}
    if extensions:
        caps["extensions"] = extensions
    else:
        del caps["extensions"]
    meta[CAPABILITIES_META] = caps
    return {**params, "_meta": meta}


# -- what the upstream's answer is -------------------------------------------------------------------


class Answer(Enum):
    RESULT = "result"  # a complete result: the task completes with it
    ERROR = "error"  # a JSON-RPC error: the task fails with it
    INPUT_REQUIRED = "input_required"  # MRTR: the task waits for the client's tasks/update
    UPSTREAM_TASK = "upstream_task"  # the upstream made a task itself: passed through, the proxy has none
    MALFORMED = "malformed"  # not a JSON-RPC response: the task fails


def classify(response: Any) -> Answer:
    """What the upstream's JSON-RPC response to the call means for the task."""
    if not isinstance(response, dict):
        return Answer.MALFORMED
    if isinstance(response.get("error"), dict):
        return Answer.ERROR
    result = response.get("result")
    if not isinstance(result, dict):
        return Answer.MALFORMED
    kind = result.get("resultType", "complete")
    if kind == "task":
        return Answer.UPSTREAM_TASK
    if kind == "input_required":
        return Answer.INPUT_REQUIRED
    return Answer.RESULT


# -- the record ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Task:
    """One task as the store keeps it. Times are the caller's clock (seconds since the epoch, so every
    replica reads the same ``expires_at``). ``owner``: the credential digest of the call that created it
    (another one gets 404). ``call``: the upstream request (JSON, without the extension) a ``tasks/update``
    retries with the input responses and the request state."""

    task_id: str
    owner: str
    status: Status
    created_at: float
    updated_at: float
    expires_at: float
    call: bytes = b""
    result: Any = None  # the completed call's result
    error: Any = None  # the failed call's JSON-RPC error (or the proxy's, with a reason)
    input_requests: Any = None
    request_state: str | None = None
    message: str | None = None  # statusMessage: why it failed or was cancelled

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "id": self.task_id,
                "owner": self.owner,
                "status": self.status.value,
                "created": self.created_at,
                "updated": self.updated_at,
                "expires": self.expires_at,
                "call": self.call.decode(),
                "result": self.result,
                "error": self.error,
                "inputRequests": self.input_requests,
                "requestState": self.request_state,
                "message": self.message,
            }
        )

    @classmethod
    def from_json(cls, data: bytes) -> Task:
        doc = orjson.loads(data)
        return cls(
            task_id=doc["id"],
            owner=doc["owner"],
            status=Status(doc["status"]),
            created_at=doc["created"],
            updated_at=doc["updated"],
            expires_at=doc["expires"],
            call=doc["call"].encode(),
            result=doc["result"],
            error=doc["error"],
            input_requests=doc["inputRequests"],
            request_state=doc["requestState"],
            message=doc["message"],
        )


def new_task(task_id: str, owner: str, call: bytes, now: float, ttl: float) -> Task:
    return Task(task_id, owner, Status.WORKING, now, now, now + ttl, call)


def expired(task: Task, now: float) -> bool:
    return now >= task.expires_at


def advance(task: Task, event: Event, now: float, **fields: Any) -> Task | Refused | Gone:
    """The task after ``event`` (with what it carries: ``result``, ``error``, ``input_requests``,
    ``request_state``, ``message``), or why not."""
    nxt = step(task.status, event)
    if not isinstance(nxt, Status):
        return nxt
    cleared: dict[str, Any] = {}
    if nxt is Status.WORKING:  # back to work after an update: the answered requests are done with
        cleared = {"input_requests": None, "request_state": None}
    return replace(task, status=nxt, updated_at=now, **{**cleared, **fields})


def _stamp(seconds: float) -> str:
    """An RFC 3339 UTC time without the clock module (the core reads no clock; it formats one)."""
    days, rest = divmod(int(seconds), 86_400)
    hour, rest = divmod(rest, 3600)
    minute, second = divmod(rest, 60)
    # civil-from-days (proleptic Gregorian), for days since 1970-01-01
    z = days + 719_468
    era = z // 146_097
    doe = z - era * 146_097
    yoe = (doe - doe // 1460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    year = yoe + era * 400 + (1 if month <= 2 else 0)
    return f"{year:04d}-{month:02d}-{day:02d}T{hour:02d}:{minute:02d}:{second:02d}Z"


def task_fields(task: Task, poll_ms: int) -> dict[str, Any]:
    """The Task shape the client sees (a ``CreateTaskResult`` is these plus ``resultType: "task"``)."""
    fields: dict[str, Any] = {
        "taskId": task.task_id,
        "status": task.status.value,
        "createdAt": _stamp(task.created_at),
        "lastUpdatedAt": _stamp(task.updated_at),
        "ttlMs": round((task.expires_at - task.created_at) * 1000),
        "pollIntervalMs": poll_ms,
    }
    if task.message is not None:
        fields["statusMessage"] = task.message
    return fields


def created_result(task: Task, poll_ms: int) -> dict[str, Any]:
    """The ``CreateTaskResult`` the client gets for its call (no result, error or input requests: the
    extension says a client must not use them there)."""
    return {"resultType": "task", **task_fields(task, poll_ms)}


def get_result(task: Task, poll_ms: int) -> dict[str, Any]:
    """A ``tasks/get``'s result: the task, with its result, error or input requests as it stands."""
    out = {"resultType": "complete", **task_fields(task, poll_ms)}
    if task.status is Status.COMPLETED:
        out["result"] = task.result
    elif task.status is Status.FAILED and task.error is not None:
        out["error"] = task.error
    elif task.status is Status.INPUT_REQUIRED and task.input_requests is not None:
        out["inputRequests"] = task.input_requests
    return out


def poll_interval_ms(task_after: float) -> int:
    """The poll interval suggested to clients: a tenth of task_after, between 100 ms and 5 s (a call that
    outlasted task_after is a long one; polling it faster buys little and costs a store read)."""
    return max(100, min(5000, round(task_after * 100)))


def task_id_problem(params: Any, header: str | None) -> str | None:
    """What is wrong with the task a ``tasks/*`` request names, or None: ``params.taskId``, a non-empty
    string within ``MAX_TASK_ID_LEN`` (``Mcp-Name`` carries the same for intermediaries; when both are
    present they must agree)."""
    if not isinstance(params, dict) or "taskId" not in params:
        return "taskId is missing"
    named = params["taskId"]
    if not isinstance(named, str) or not named:
        return "taskId is not a non-empty string"
    if len(named) > MAX_TASK_ID_LEN:
        return f"taskId is longer than {MAX_TASK_ID_LEN} characters"
    if header is not None and header != named:
        return "Mcp-Name names another task than taskId"
    return None


def task_id_of(params: Any, header: str | None) -> str | None:
    """The task a ``tasks/*`` request names (``task_id_problem``), None if it names none properly."""
    return None if task_id_problem(params, header) is not None else str(params["taskId"])


def is_ours(task_id: str) -> bool:
    """Whether a task id is one the proxy minted (else the upstream's own: its tasks/* pass through)."""
    return task_id.startswith(TASK_ID_PREFIX)


def upstream_makes_tasks(response: Any) -> bool:
    """Whether an upstream's answer to ``server/discover`` declares the tasks extension: it makes tasks
    itself, and the proxy leaves its calls as they are."""
    result = response.get("result") if isinstance(response, dict) else None
    caps = result.get("capabilities") if isinstance(result, dict) else None
    extensions = caps.get("extensions") if isinstance(caps, dict) else None
    return isinstance(extensions, dict) and TASKS_EXTENSION in extensions


def progress_message(doc: Any) -> str | None:
    """What a ``notifications/progress`` says, as a task's ``statusMessage`` (the extension's place for a
    working task's progress): its message, else ``progress/total``."""
    if not isinstance(doc, dict) or doc.get("method") != "notifications/progress":
        return None
    params = doc.get("params")
    if not isinstance(params, dict):
        return None
    message = params.get("message")
    if isinstance(message, str) and message:
        return message[:MAX_STATUS_MESSAGE]
    progress, total = params.get("progress"), params.get("total")
    if not isinstance(progress, int | float):
        return None
    return f"{progress}/{total}" if isinstance(total, int | float) else f"{progress}"


def progressed(task: Task, message: str, now: float) -> Task | Refused:
    """A working task with its newest progress (a status message; the status does not change)."""
    if task.status is not Status.WORKING:
        return REFUSED
    return replace(task, message=message, updated_at=now)
