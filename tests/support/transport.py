"""A client transport for ``http.view.ClientWriter`` in unit tests: it reports a chosen write-buffer level."""

from __future__ import annotations


class BufferedTransport:
    """Reports ``buffered`` bytes waiting, under asyncio's default limits (16 KiB low, 64 KiB high water)."""

    def __init__(self, buffered: int = 0) -> None:
        self.buffered = buffered

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return 16 * 1024, 64 * 1024
