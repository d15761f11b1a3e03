"""Reusable test infrastructure: a cutting TCP relay (`relay`), official-SDK client helpers (`sdk`), and
small shared constants / probes used by ``tests/conftest.py``."""

from __future__ import annotations

import socket
import uuid

import orjson

__all__ = [
    "EVENT_STORE_RETRY_MS",
    "INITIALIZE",
    "INITIALIZE_BODY",
    "MCP_HEADERS",
    "new_session_id",
    "redis_ping",
]

INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "t", "version": "1"},
    },
}
"""A client's ``initialize`` request (2025-11-25), for tests that speak raw HTTP."""
INITIALIZE_BODY = orjson.dumps(INITIALIZE)
MCP_HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
"""What an MCP client's POST carries: a JSON body, and it accepts a JSON or an SSE answer."""

EVENT_STORE_RETRY_MS = 200
"""``retry`` (ms) of the ``example_upstream_with_event_store`` fixture: SDK clients reconnect after it."""


def redis_ping(port: int, host: str = "127.0.0.1", timeout: float = 1.0) -> bool:
    """Whether a Redis on ``host:port`` answers ``PING`` (raw RESP over a socket, no client library)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64) == b"+PONG\r\n"
    except OSError:
        return False


def new_session_id() -> str:
    """A session id unique to its test, so a shared backend (Redis) needs no flushing between tests."""
    return f"sess-{uuid.uuid4().hex}"
