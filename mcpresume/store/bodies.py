"""This process's copies of event bodies held in the Redis store, by their field in the session's bodies hash.

A field's name is unique (an append's: this process's random token and a counter; a priming event's: its
session's random epoch and its seq), written once and never changed, only deleted when its events leave the
window: a copy is never stale, so a view of this process reads the bodies its pumps appended without a round
trip for them. Bounded by bytes, least recently used out first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

CACHE_BYTES: Final = 32 << 20


class Bodies:
    __slots__ = ("_items", "capacity", "size")

    def __init__(self, capacity: int = CACHE_BYTES) -> None:
        self._items: OrderedDict[bytes, bytes] = OrderedDict()
        self.capacity = capacity
        self.size = 0

    def put(self, field: bytes, body: bytes) -> None:
        if len(body) > self.capacity:
            return
        old = self._items.pop(field, None)
        if old is not None:
            self.size -= len(old)
        self._items[field] = body
        self.size += len(body)
        while self.size > self.capacity:
            _, dropped = self._items.popitem(last=False)
            self.size -= len(dropped)

    def get(self, field: bytes) -> bytes | None:
        body = self._items.get(field)
        if body is not None:
            self._items.move_to_end(field)
        return body

    def __len__(self) -> int:
        return len(self._items)
