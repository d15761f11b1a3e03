"""What a campaign records, and reading a run back.

Every party appends JSON lines to files of its own in the run's directory, each line one record with ``ev``
(what happened) and ``t`` (wall-clock seconds, ``time.time()``: every process runs on this one machine):

``nemesis.jsonl`` (the campaign process)
    ``campaign`` (first line: layout, seed, lease, the plan), ``proc`` (a process ``started``,
    ``killed``, ``stopped``, ``continued``, ``exited`` on its own, ``failed_start``: name, pid, code),
    ``fault`` (phase ``start`` / ``end`` of one fault: id, kind, target, episode), ``cut`` (connections
    cut), ``heal``, ``end``.
``upstream-<pod>.jsonl`` or ``upstream.jsonl`` (each upstream; a restarted one appends to its file)
    ``start`` (pid), ``session`` (a session it created: sid), ``delete`` (a session it ended on a DELETE),
    ``begin`` / ``end`` / ``cancelled`` of one execution of ``work`` (sid, rid, tag, steps).
``client-<id>.jsonl`` (each client process)
    ``client`` (sdk), ``session`` (initialized: sid, conn), ``init_error``, ``call`` (tag, sid, steps),
    ``progress`` (tag, p), ``result`` (tag, text), ``error`` (tag, code, message, reason), ``timeout``
    (tag: no outcome within the call deadline), ``http`` (an HTTP answer >= 400: method, status, reason,
    sid, tag), ``sent`` / ``response`` (every JSON-RPC request sent and response received, as the SDK's
    transport passed them: conn, rid, method).

A record is one ``write`` on a file opened with ``O_APPEND``: a process killed with SIGKILL leaves whole
lines behind (the reader skips a torn last line all the same).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Record = dict[str, Any]

NEMESIS_LOG = "nemesis.jsonl"
UPSTREAM_PREFIX = "upstream"
CLIENT_PREFIX = "client-"


class JsonLines:
    """An append-only JSON-lines file: each record one ``write``, stamped with ``t`` if it has none."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, ev: str, **fields: Any) -> Record:
        record: Record = {"ev": ev, "t": fields.pop("t", None) or time.time(), **fields}
        os.write(self._fd, json.dumps(record, separators=(",", ":")).encode() + b"\n")
        return record

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_jsonl(path: Path) -> list[Record]:
    records: list[Record] = []
    for line in path.read_bytes().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn line of a process killed mid-write
        if isinstance(record, dict) and "ev" in record and "t" in record:
            records.append(record)
    return records


@dataclass
class RunHistory:
    """One layout's run, as its files say: what the checker reads."""

    layout: str
    lease: float
    seed: int
    nemesis: list[Record] = field(default_factory=list)
    upstreams: list[Record] = field(default_factory=list)
    clients: list[Record] = field(default_factory=list)

    @classmethod
    def from_records(
        cls, nemesis: list[Record], upstreams: list[Record], clients: list[Record]
    ) -> RunHistory:
        head = next((r for r in nemesis if r["ev"] == "campaign"), None)
        if head is None:
            raise ValueError("the nemesis log has no campaign record")
        return cls(
            layout=str(head["layout"]),
            lease=float(head["lease"]),
            seed=int(head.get("seed", 0)),
            nemesis=sorted(nemesis, key=lambda r: r["t"]),
            upstreams=sorted(upstreams, key=lambda r: r["t"]),
            clients=sorted(clients, key=lambda r: r["t"]),
        )

    @classmethod
    def load(cls, directory: Path) -> RunHistory:
        upstreams: list[Record] = []
        clients: list[Record] = []
        for path in sorted(directory.glob("*.jsonl")):
            if path.name.startswith(UPSTREAM_PREFIX):
                upstreams += read_jsonl(path)
            elif path.name.startswith(CLIENT_PREFIX):
                clients += read_jsonl(path)
        return cls.from_records(read_jsonl(directory / NEMESIS_LOG), upstreams, clients)
