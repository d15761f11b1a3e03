"""How the proxy names a session in its logs: by a short, stable hash, never the id itself (session ids
are bearer-like)."""

from __future__ import annotations

import hashlib


def log_id(session_id: str) -> str:
    """A short, stable hash of a session id: full session ids stay out of logs."""
    return hashlib.sha256(session_id.encode("utf-8", "surrogateescape")).hexdigest()[:10]
