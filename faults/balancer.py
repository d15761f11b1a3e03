"""A round-robin TCP balancer with no affinity of any kind, that can cut every client connection at once.

Each client connection goes to the next backend in turn; when a backend refuses the connection (a killed
pod), the next one is tried, as a balancer's health check would soon do. A stopped backend (SIGSTOP) still
accepts (the kernel's backlog): its connections wait, as they would behind a real balancer until its health
check notices. The campaign's clients open one connection per request (no keep-alive), so every request,
re-attach and hop of a session lands anywhere.

`Balancer.cut` aborts every client connection and its backend connection at once (a reset each way): what
a balancer's restart or a network partition does to the clients' streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

LOOPBACK = "127.0.0.1"
CHUNK = 64 * 1024
CONNECT_TIMEOUT = 2.0


class Balancer:
    def __init__(self, backends: list[int], port: int = 0) -> None:
        self.backends = backends
        self.port = port
        self._turn = itertools.count()
        self._server: asyncio.Server | None = None
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.connections = 0

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/mcp"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, LOOPBACK, self.port, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]

    def cut(self) -> int:
        """Reset every client connection (and its backend connection); how many were cut."""
        pairs = list(self._pairs)
        for client, backend in pairs:
            for writer in (client, backend):
                writer.transport.abort()
        self._pairs.clear()
        return len(pairs)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.cut()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        first = next(self._turn)
        for attempt in range(len(self.backends)):
            port = self.backends[(first + attempt) % len(self.backends)]
            with contextlib.suppress(OSError, TimeoutError):
                return await asyncio.wait_for(asyncio.open_connection(LOOPBACK, port), CONNECT_TIMEOUT)
        return None

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            backend = await self._connect()
            if backend is None:
                client_writer.transport.abort()
                return
            backend_reader, backend_writer = backend
            pair = (client_writer, backend_writer)
            self._pairs.add(pair)
            try:
                await asyncio.gather(
                    _pipe(client_reader, backend_writer), _pipe(backend_reader, client_writer)
                )
            finally:
                self._pairs.discard(pair)
                for writer in pair:
                    writer.transport.abort()
        finally:
            self._tasks.discard(task)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        writer.transport.abort()
