"""A TCP proxy for tests: a browser talks to a server through it, and the test cuts the line.

``drop()`` aborts every connection through it at once (no WebSocket close frame, as a network
failure would: the browser reports 1006, the server parks the session); ``refuse(True)`` makes
it close new connections at once (the server looks down); ``refuse_websockets(True)`` aborts
only WebSocket handshakes (a socket that fails to open while the server answers HTTP: the
browser says 1006, ``/healthz`` is fine), counting them in ``websockets_refused``;
``hold(True)`` stops forwarding what the server sends (the connections stay open; the bytes
wait, and TCP's window holds the server back, as a stalled network does) until ``hold(False)``
lets it all through at once;
``rewrite_host=True`` sends the server its own address as ``Host``, as a reverse proxy does by
default (nginx's ``proxy_pass``), so a page's ``Origin`` is not the server's own; ``target``
may be changed to point at a restarted server. It runs its own event loop in a thread, so sync (Playwright) tests can
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
        self.refusing_websockets = False
        self.websockets_refused = 0
        self.rewrite_host = False
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._links: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()  # cleared while holding the server's bytes back
        self._flowing.set()
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

    def hold(self, holding: bool) -> None:
        """While holding, nothing the server sends reaches the client; released, it all goes at once."""
        self._run(self._flowing.clear if holding else self._flowing.set)

    def refuse(self, refusing: bool) -> None:
        """While refusing, a new connection is closed as soon as it arrives."""
        self.refusing = refusing

    def refuse_websockets(self, refusing: bool) -> None:
        """While refusing, a connection whose request is a WebSocket handshake is aborted before it reaches
        the server; plain HTTP requests go through."""
        self.refusing_websockets = refusing

    def _client_bytes(self, data: bytes) -> bytes | None:
        """What goes on to the server for ``data`` from the client; None: abort the connection."""
        if self.refusing_websockets and b"upgrade: websocket" in data.lower():
            self.websockets_refused += 1
            return None
        if self.rewrite_host:
            ours, theirs = f"Host: 127.0.0.1:{self.port}\r\n", f"Host: 127.0.0.1:{self.target}\r\n"
            data = data.replace(ours.encode(), theirs.encode())
        return data

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

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, from_client: bool) -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await source.read(65536):
                    if not from_client:
                        await self._flowing.wait()
                    passed = self._client_bytes(data) if from_client else data
                    if passed is None:  # a refused handshake: cut both sides, no answer
                        writer.transport.abort()
                        upstream_writer.transport.abort()
                        break
                    sink.write(passed)
                    await sink.drain()
            sink.close()  # the other side ended: end this one too, after what is buffered
            self._links.difference_update(pair)

        await asyncio.gather(pipe(reader, upstream_writer, True), pipe(upstream_reader, writer, False))
