"""The HTTP + WebSocket application (Starlette): routes, authentication, origins.

Owns: ``/`` (the browser player), ``/static`` and ``/favicon.ico``, ``GET /healthz``,
``GET /v1/models``, ``POST /v1/whep/{session_id}`` and ``DELETE`` on its resource (WebRTC viewers
signalled as WHEP: webrtc.py), ``POST /v1/webrtc`` and ``DELETE`` on its resource (a whole session over
WebRTC: the ``/v1/world`` protocol on a data channel, frames on a video track: webrtc_session.py),
``POST /admin/drain`` (a drain, as SIGTERM begins one: drain.py; behind the
token), ``POST /v1/origin`` (whether the request's ``Origin`` may open a socket: a
browser's handshake refusal reads only as 1006, so the player asks), ``GET /metrics``,
``WS /v1/world`` and ``WS /v1/realtime/video`` (vllm-omni's realtime video protocol, over the
same runtime and sessions); the optional bearer token (header,
or the ``bearer.<token>`` WebSocket subprotocol browsers can send), the same for both
sockets; the origin allow-list; a refused handshake's answer (HTTP 401 for the token, 403 for
the origin, 404 for a path no socket is at, each with its JSON error). Each ``/v1/world`` socket gets one
:class:`~worldserve.server.connection.Connection`, each ``/v1/realtime/video`` socket one
:class:`~worldserve.server.realtime_video.RealtimeVideoConnection`; the worlds they start,
join and resume are kept in one :class:`~worldserve.server.host.WorldHosts`.
:func:`end_worlds` is the server's stop: every world ends with ``session.closed {reason:
"shutdown"}`` to each member, then each socket closes with 1001 (the caller runs it when a drain is
over, or at once; before
uvicorn closes the sockets; the lifespan's end ends any world still open, with no one left
to tell).

Must not know: how sessions, engines or models work.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.requests import HTTPConnection, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from worldserve.ice import parse_ice_server
from worldserve.runtime import Runtime
from worldserve.server.config import ServerConfig
from worldserve.server.connection import Connection
from worldserve.server.directory import Directory
from worldserve.server.drain import Drain
from worldserve.server.host import WorldHosts
from worldserve.server.metrics import ServerMetrics
from worldserve.server.realtime_video import RealtimeVideoConnection
from worldserve.server.waiting import waiting_room
from worldserve.server.webrtc import MAX_OFFER_BYTES, WhepError, WhepPeers, whep_url
from worldserve.server.webrtc_session import DataChannelSocket, WebRTCSessions

__all__ = ["PROTOCOL_NAME", "create_app", "end_worlds"]

#: The WebSocket subprotocol the server speaks (offered optionally by clients).
PROTOCOL_NAME = "worldserve.v1"
_BEARER_PREFIX = "bearer."


#: The WebSocket endpoints (an unknown path is answered HTTP 404, naming them).
_SOCKETS = ("/v1/world", "/v1/realtime/video")


async def _deny(websocket: WebSocket, response: Response) -> None:
    """Refuse the handshake with ``response`` (its status and JSON body reach the client); a server
    without the denial-response extension can only close it (the client then sees HTTP 403)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(response)
    else:
        await websocket.close(code=1008)


def _static_dir() -> str:
    return str(resources.files("worldserve.server") / "static")


def _token_ok(expected: str | None, offered: str | None) -> bool:
    if expected is None:
        return True
    return offered is not None and hmac.compare_digest(expected.encode(), offered.encode())


def _bearer(connection: HTTPConnection) -> str | None:
    header = connection.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _origin_ok(connection: HTTPConnection, allowed: tuple[str, ...]) -> bool:
    origin = connection.headers.get("origin")
    if origin is None:
        return True  # not a browser: the token (if any) is what guards the socket
    if "*" in allowed or origin in allowed:
        return True
    host = connection.headers.get("host", "")
    return urlsplit(origin).netloc == host and host != ""


def create_app(
    config: ServerConfig,
    runtime_factory: Callable[[], AbstractAsyncContextManager[Runtime]],
    directory: Directory | None = None,
) -> Starlette:
    """Build the app; ``runtime_factory()`` is entered for the app's lifetime (it starts the workers).
    ``directory``: the service's session directory, when this is one of several front-ends (its worlds
    are published there while the app runs, and it is closed with the app)."""
    state: dict[str, Any] = {}

    def backend() -> Runtime:
        runtime: Runtime = state["runtime"]
        return runtime

    def metrics() -> ServerMetrics:
        value: ServerMetrics = state["metrics"]
        return value

    def unauthorized() -> Response:
        return JSONResponse(
            {"error": {"code": "unauthorized", "message": "missing or wrong bearer token."}},
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )

    async def index(request: Request) -> Response:
        return FileResponse(f"{_static_dir()}/index.html", media_type="text/html")

    async def favicon(request: Request) -> Response:
        return FileResponse(f"{_static_dir()}/favicon.svg", media_type="image/svg+xml")

    async def origin(request: Request) -> Response:
        """Whether this request's ``Origin`` (a browser sends it on a POST, as on a socket's handshake) is one
        the sockets take: no token needed, it tells only the caller's own origin's fate."""
        return JSONResponse(
            {
                "origin": request.headers.get("origin"),
                "allowed": _origin_ok(request, config.allowed_origins),
            }
        )

    async def healthz(request: Request) -> Response:
        """200 ``ok``; 503 ``draining`` while a drain runs (a balancer that checks it sends no new player)."""
        runtime = backend()
        capacity = runtime.capacity()
        room = state["room"]
        drain: Drain = state["drain"]
        return JSONResponse(
            {
                "status": "draining" if drain.draining else "ok",
                "drain": drain.health(),
                "model": runtime.spec.name,
                "sessions": len(runtime.manager),
                "capacity": {
                    "free": capacity.free,
                    "slots": capacity.slots,
                    "room": capacity.room,
                    "workers_alive": capacity.workers_alive,
                },
                "queue": {
                    "waiting": room.waiting,
                    "max": room.max_waiting,
                    "line": "service" if room.shared else "front-end",  # the service's (several front-ends)
                },
                "directory": {"state": "off"} if directory is None else directory.health(),
            },
            status_code=503 if drain.draining else 200,
        )

    ice_links = [parse_ice_server(server).link() for server in config.ice_servers]

    def whep_refusal(error: WhepError) -> Response:
        return JSONResponse({"error": {"code": error.code, "message": str(error)}}, status_code=error.status)

    async def sdp_offer(request: Request) -> str:
        """The request's SDP offer; ``WhepError`` unless it is ``application/sdp`` within ``MAX_OFFER_BYTES``."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/sdp":
            raise WhepError(415, "bad_offer", "send the offer as application/sdp.")
        body = await request.body()
        if len(body) > MAX_OFFER_BYTES:
            raise WhepError(413, "bad_offer", f"the offer exceeds {MAX_OFFER_BYTES} bytes.")
        return body.decode(errors="replace")

    def with_ice_links(response: Response) -> Response:
        """The ICE servers, one ``Link: <URL>; rel="ice-server"`` header each (RFC 9725, 4.6)."""
        for link in ice_links:
            response.headers.append("Link", link)
        return response

    def sdp_answer(answer: str, path: str) -> Response:
        """201 with the SDP answer, ``Location``: the peer's resource (under this front-end's public URL), and the
        ICE servers in ``Link`` headers, as WHIP/WHEP endpoints tell them."""
        location = f"{(config.public_url or '').rstrip('/')}{path}"
        answered = Response(answer, status_code=201, media_type="application/sdp", headers={"Location": location})
        return with_ice_links(answered)

    async def whep_offer(request: Request) -> Response:
        """WHEP: an SDP offer in, the answer out (201, ``Location``: the viewer's resource). The bearer token is a
        share token of the world (it grants watching that world, and nothing else)."""
        session_id = request.path_params["session_id"]
        peers: WhepPeers = state["whep"]
        try:
            if request.method == "OPTIONS":  # before the offer: the ICE servers to gather with (Link headers)
                peers.authorize(session_id, _bearer(request))
                return with_ice_links(Response(status_code=204))
            resource, answer = await peers.offer(session_id, _bearer(request), await sdp_offer(request))
        except WhepError as error:
            if error.status == 404 and directory is not None:  # it lives on another front-end: go there
                url = await directory.find(session_id)
                if url is not None:
                    return Response(status_code=307, headers={"Location": whep_url(url, session_id)})
            return whep_refusal(error)
        return sdp_answer(answer, f"/v1/whep/{session_id}/{resource}")

    async def whep_resource(request: Request) -> Response:
        """WHEP: ``DELETE`` leaves; a trickled candidate (``PATCH``) is not taken: the answer had them all."""
        if request.method != "DELETE":
            return whep_refusal(WhepError(405, "not_supported", "candidates are not trickled: the SDP had them all."))
        peers: WhepPeers = state["whep"]
        try:
            await peers.leave(request.path_params["session_id"], request.path_params["resource"])
        except WhepError as error:
            return whep_refusal(error)
        return Response(status_code=200)

    async def webrtc_offer(request: Request) -> Response:
        """A whole session over WebRTC (webrtc_session.py): the server's token, as on every route; an SDP offer
        with a data channel and video in, the answer out (201, ``Location``: the peer's resource)."""
        if not _token_ok(config.token, _bearer(request)):
            return unauthorized()
        if request.method == "OPTIONS":  # before the offer: the ICE servers to gather with (Link headers)
            return with_ice_links(Response(status_code=204))
        peers: WebRTCSessions = state["webrtc"]
        try:
            resource, answer = await peers.offer(await sdp_offer(request))
        except WhepError as error:
            return whep_refusal(error)
        return sdp_answer(answer, f"/v1/webrtc/{resource}")

    async def webrtc_resource(request: Request) -> Response:
        if request.method != "DELETE":
            return whep_refusal(WhepError(405, "not_supported", "candidates are not trickled: the SDP had them all."))
        peers: WebRTCSessions = state["webrtc"]
        try:
            await peers.leave(request.path_params["resource"])
        except WhepError as error:
            return whep_refusal(error)
        return Response(status_code=200)

    async def admin_drain(request: Request) -> Response:
        """Begin draining (as SIGTERM does): behind the token, or from this machine on a server without one."""
        if config.token is None:
            client = request.client
            if client is None or not _loopback(client.host):
                message = "/admin/drain on a server without --token is taken from this machine only."
                return JSONResponse({"error": {"code": "forbidden", "message": message}}, status_code=403)
        elif not _token_ok(config.token, _bearer(request)):
            return unauthorized()
        drain: Drain = state["drain"]
        begun = drain.begin("POST /admin/drain")
        return JSONResponse({**drain.health(), "begun": begun}, status_code=202)

    async def models(request: Request) -> Response:
        if not _token_ok(config.token, _bearer(request)):
            return unauthorized()
        return JSONResponse({"object": "list", "data": [backend().spec.to_dict()]})

    async def metrics_route(request: Request) -> Response:
        if not _token_ok(config.token, _bearer(request)):
            return unauthorized()
        return Response(metrics().render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def admitted(websocket: WebSocket) -> list[str] | None:
        """The subprotocols offered, once the token and origin are right; None: refused (HTTP 401
        for the token, 403 for the origin, each with its JSON error)."""
        offered = [
            part.strip() for part in websocket.headers.get("sec-websocket-protocol", "").split(",") if part.strip()
        ]
        token = _bearer(websocket)
        if token is None:
            token = next((p[len(_BEARER_PREFIX) :] for p in offered if p.startswith(_BEARER_PREFIX)), None)
        if not _token_ok(config.token, token):
            await _deny(websocket, unauthorized())
            return None
        if not _origin_ok(websocket, config.allowed_origins):
            origin = websocket.headers.get("origin")
            message = f"origin {origin} is not allowed (the server's --allow-origin lists the origins it takes)."
            await _deny(websocket, JSONResponse({"error": {"code": "origin_refused", "message": message}}, 403))
            return None
        return offered

    async def unknown_socket(websocket: WebSocket) -> None:
        message = f"no WebSocket endpoint at {websocket.url.path}: this server's are {' and '.join(_SOCKETS)}."
        await _deny(websocket, JSONResponse({"error": {"code": "not_found", "message": message}}, 404))

    async def serve(connection: Connection | RealtimeVideoConnection) -> None:
        """Run one socket's connection, known to :func:`end_worlds` (the server's stop) while it runs."""
        connections: set[Connection | RealtimeVideoConnection] = state["connections"]
        connections.add(connection)
        try:
            await connection.run()
        finally:
            connections.discard(connection)

    async def world(websocket: WebSocket) -> None:
        offered = await admitted(websocket)
        if offered is None:
            return
        await websocket.accept(subprotocol=PROTOCOL_NAME if PROTOCOL_NAME in offered else None)
        await serve(Connection(websocket, backend(), config, metrics(), state["hosts"], state["room"]))

    async def realtime_video(websocket: WebSocket) -> None:
        offered = await admitted(websocket)
        if offered is None:
            return
        # vllm-omni's clients offer no subprotocol; a browser that sends its token as one gets it back.
        await websocket.accept(subprotocol=offered[0] if offered else None)
        await serve(RealtimeVideoConnection(websocket, backend(), config, metrics(), state["hosts"], state["room"]))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with runtime_factory() as runtime:
            state["runtime"] = runtime
            state["metrics"] = ServerMetrics(runtime.manager, runtime.engine.stats)
            state["hosts"] = hosts = WorldHosts(directory)
            state["room"] = room = waiting_room(runtime, config, hosts, state["metrics"])
            state["connections"] = set()
            state["drain"] = Drain(config.drain_timeout_s, room, lambda: len(hosts))
            state["whep"] = whep = WhepPeers(hosts, ice_servers=config.ice_servers, media=config.whep_media)

            async def serve_socket(socket: DataChannelSocket) -> None:
                connection = Connection(socket, runtime, config, state["metrics"], hosts, room)
                socket.on_started = connection.frames_started  # frames on a track cannot be called back
                try:
                    await serve(connection)
                finally:
                    copies = state["metrics"].webrtc_copies
                    copies.labels(used="taken").inc(socket.fast_taken)
                    copies.labels(used="unused").inc(socket.fast_unused)

            state["webrtc"] = webrtc = WebRTCSessions(
                serve_socket,
                lambda: runtime.spec.fps,
                ice_servers=config.ice_servers,
                frames=lambda: runtime.spec.frames_per_chunk + 2,
                max_message_bytes=config.max_start_bytes,
            )
            if directory is not None:
                directory.start(hosts.session_ids)
                room.start_sharing()
            try:
                yield
                await room.aclose()
                await whep.aclose()
                await webrtc.aclose()
                await hosts.shutdown(runtime.lost)  # a runtime that lost its workers: each world says why
            finally:
                if directory is not None:
                    await directory.aclose()
                state.clear()

    app = Starlette(
        routes=[
            Route("/", index),
            Route("/healthz", healthz),
            Route("/v1/models", models),
            Route("/v1/origin", origin, methods=["POST"]),
            Route("/admin/drain", admin_drain, methods=["POST"]),
            Route("/v1/whep/{session_id}", whep_offer, methods=["POST", "OPTIONS"]),
            Route("/v1/whep/{session_id}/{resource}", whep_resource, methods=["DELETE", "PATCH"]),
            Route("/v1/webrtc", webrtc_offer, methods=["POST", "OPTIONS"]),
            Route("/v1/webrtc/{resource}", webrtc_resource, methods=["DELETE", "PATCH"]),
            Route("/favicon.ico", favicon),
            Route("/metrics", metrics_route),
            WebSocketRoute("/v1/world", world),
            WebSocketRoute("/v1/realtime/video", realtime_video),
            Mount("/static", StaticFiles(directory=_static_dir()), name="static"),
            WebSocketRoute("/{path:path}", unknown_socket),  # Starlette's own answer: a bare HTTP 403
        ],
        lifespan=lifespan,
    )
    app.state.worldserve = state
    return app


async def end_worlds(app: Starlette, *, flush_timeout: float = 5.0) -> None:
    """The server stops: end every world (each member is sent ``session.closed {reason: "shutdown"}``,
    after ``session.failed`` when the runtime lost its workers; each session released), then close
    every socket with 1001 once what was queued for it is written (a client not reading gets
    ``flush_timeout`` seconds)."""
    state: dict[str, Any] = getattr(app.state, "worldserve", {})
    hosts: WorldHosts | None = state.get("hosts")
    if hosts is None:
        return  # not started, or already stopped
    await state["room"].aclose()  # those waiting in line are refused
    runtime: Runtime = state["runtime"]
    await hosts.shutdown(runtime.lost)  # a runtime that lost its workers: each world says why first
    connections: set[Connection | RealtimeVideoConnection] = state.get("connections", set())
    await asyncio.gather(*(connection.close_for_shutdown(flush_timeout) for connection in list(connections)))
