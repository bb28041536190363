"""A TCP proxy for tests: a browser talks to a server through it, and the test cuts the line.

``drop()`` aborts every connection through it at once (no WebSocket close frame, as a network
failure would: the browser reports 1006, the server parks the session); ``refuse(True)`` makes
it close new connections at once (the server looks down); ``target`` may be changed to point
at a restarted server. It runs its own event loop in a thread, so sync (Playwright) tests can
use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class TcpProxy:
    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.refusing = False
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._links: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy", daemon=True)

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop
        ).result(10)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.drop()
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def drop(self) -> None:
        """Cut every connection through the proxy now, with no goodbye on either side."""

        def abort_all() -> None:
            for writer in list(self._links):
                writer.transport.abort()
            self._links.clear()

        self._run(abort_all)

    def refuse(self, refusing: bool) -> None:
        """While refusing, a new connection is closed as soon as it arrives."""
        self.refusing = refusing

    def _run(self, function: object) -> None:
        done = threading.Event()

        def call() -> None:
            try:
                function()  # type: ignore[operator]
            finally:
                done.set()

        self._loop.call_soon_threadsafe(call)
        done.wait(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()  # nothing listens there (a server restarting)
            return
        pair = {writer, upstream_writer}
        self._links.update(pair)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.close()  # the other side ended: end this one too, after what is buffered
            self._links.difference_update(pair)

        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))
