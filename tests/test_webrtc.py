"""WebRTC viewers signalled as WHEP, against a real server: an aiortc peer (the role of any WHEP player)
offers with a world's viewer token, gets the answer and the world's frames as a video track, leaves with
DELETE; refused offers get clear HTTP errors and leave the server and the world as they were."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

aiortc = pytest.importorskip("aiortc")

from server_harness import RunningServer, start_server  # noqa: E402
from worldserve.client import WorldClient  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = start_server("--model", "procedural")
    yield running
    running.stop()


def _request(url: str, method: str, body: bytes = b"", headers: dict[str, str] | None = None) -> tuple[int, Any, str]:
    request = urllib.request.Request(url, data=body or None, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read().decode()


async def _post_offer(server: RunningServer, session_id: str, token: str | None, sdp: str) -> tuple[int, Any, str]:
    headers = {"Content-Type": "application/sdp"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    url = f"{server.http}/v1/whep/{session_id}"
    return await asyncio.to_thread(_request, url, "POST", sdp.encode(), headers)


async def _offer() -> tuple[Any, asyncio.Future[Any]]:
    pc = aiortc.RTCPeerConnection()
    pc.addTransceiver("video", direction="recvonly")
    track: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    @pc.on("track")  # type: ignore[misc]
    def on_track(received: Any) -> None:
        if not track.done():
            track.set_result(received)

    await pc.setLocalDescription(await pc.createOffer())
    return pc, track


async def test_a_whep_viewer_watches_a_shared_world_and_leaves(server: RunningServer) -> None:
    async with WorldClient(server.ws) as host:
        info = await host.start(seed=5, share_viewers=True)
        assert info.viewer_token
        shown: list[np.ndarray] = []

        async def play() -> None:  # the host plays on (its acks pace the world)
            while True:
                shown.extend((await host.next_chunk(timeout=10)).frames)

        playing = asyncio.create_task(play())
        pc, track = await _offer()
        try:
            offer = pc.localDescription.sdp
            status, headers, answer = await _post_offer(server, info.session_id, info.viewer_token, offer)
            assert status == 201, answer
            assert headers["Content-Type"].startswith("application/sdp")
            # The offer takes H.264: the viewer is sent the world's own stream, only packetised for it.
            assert "H264/90000" in answer
            assert "VP8/90000" not in answer
            location = headers["Location"]
            assert location.startswith(f"/v1/whep/{info.session_id}/")
            await pc.setRemoteDescription(aiortc.RTCSessionDescription(sdp=answer, type="answer"))
            video = await asyncio.wait_for(track, 20)
            received = []
            for _ in range(16):
                frame = await asyncio.wait_for(video.recv(), 20)
                received.append(frame.to_ndarray(format="rgb24"))
            assert received[-1].shape == shown[0].shape
            # Each frame the viewer got is one of the world's (after a lossy encode): close to a frame shown.
            for frame in received[4:]:
                error = min(float(np.abs(frame.astype(int) - made.astype(int)).mean()) for made in shown)
                assert error < 12.0, error
            status, _, _ = await asyncio.to_thread(_request, server.http + location, "DELETE")
            assert status == 200
            status, _, _ = await asyncio.to_thread(_request, server.http + location, "DELETE")
            assert status == 404  # left already
            count = len(shown)
            while len(shown) < count + 8:  # noqa: ASYNC110 -- the world goes on for its host
                await asyncio.sleep(0.05)
        finally:
            playing.cancel()
            await pc.close()
        await host.close()


async def test_refused_offers_get_clear_http_errors_and_the_world_plays_on(server: RunningServer) -> None:
    async with WorldClient(server.ws) as host:
        info = await host.start(seed=6, share_viewers=True)
        await host.next_chunk(timeout=10)
        pc, _ = await _offer()
        sdp = pc.localDescription.sdp
        try:
            cases = [
                (await _post_offer(server, info.session_id, None, sdp), 401, "unauthorized"),
                (await _post_offer(server, info.session_id, "not-a-share-token", sdp), 403, "join_refused"),
                (await _post_offer(server, "no-such-world", info.viewer_token, sdp), 404, "unknown_session"),
                (await _post_offer(server, info.session_id, info.viewer_token, "v=0 hello"), 400, "bad_offer"),
            ]
            headers = {"Content-Type": "text/plain", "Authorization": f"Bearer {info.viewer_token}"}
            plain = await asyncio.to_thread(
                _request, f"{server.http}/v1/whep/{info.session_id}", "POST", sdp.encode(), headers
            )
            cases.append((plain, 415, "bad_offer"))
            for (status, _, body), want, code in cases:
                assert status == want, body
                assert json.loads(body)["error"]["code"] == code
        finally:
            await pc.close()
        for _ in range(3):  # the world and the server as they were
            await host.next_chunk(timeout=10)
        status, _, _ = await asyncio.to_thread(_request, server.http + "/healthz", "GET")
        assert status == 200
        await host.close()


@pytest.fixture(scope="module")
def ice_server() -> Iterator[RunningServer]:
    running = start_server(
        "--model", "procedural", "--ice-server", "stun:127.0.0.1:3478",
        "--ice-server", "turn:ana:s3%22cret@127.0.0.1:3478?transport=tcp",
    )  # fmt: skip
    yield running
    running.stop()


async def test_the_ice_servers_are_told_in_link_headers_to_a_viewer_of_the_world_only(
    ice_server: RunningServer,
) -> None:
    """WHEP clients ask with OPTIONS before their offer (RFC 9725, 4.6: ``Link: <URL>; rel="ice-server"``): a WHEP
    endpoint tells them for a share token of its world only (TURN credentials are not for anyone), /v1/webrtc for
    the server's token; bad asks get the offer's errors, and the world plays on."""
    stun = '<stun:127.0.0.1:3478>; rel="ice-server"'
    turn = (
        '<turn:127.0.0.1:3478?transport=tcp>; rel="ice-server"; username="ana"; credential="s3\\"cret";'
        ' credential-type="password"'
    )
    async with WorldClient(ice_server.ws) as host:
        info = await host.start(seed=6, share_viewers=True)
        await host.next_chunk(timeout=10)
        whep = f"{ice_server.http}/v1/whep/{info.session_id}"

        def ask(url: str, token: str | None) -> tuple[int, Any, str]:
            return _request(url, "OPTIONS", headers={"Authorization": f"Bearer {token}"} if token else {})

        status, headers, _ = await asyncio.to_thread(ask, whep, info.viewer_token)
        assert (status, headers.get_all("Link")) == (204, [stun, turn])
        status, headers, _ = await asyncio.to_thread(ask, f"{ice_server.http}/v1/webrtc", None)  # no --token
        assert (status, headers.get_all("Link")) == (204, [stun, turn])
        for url, token, want, code in [
            (whep, None, 401, "unauthorized"),
            (whep, "not-a-share-token", 403, "join_refused"),
            (f"{ice_server.http}/v1/whep/no-such-world", info.viewer_token, 404, "unknown_session"),
        ]:
            status, headers, body = await asyncio.to_thread(ask, url, token)
            assert (status, json.loads(body)["error"]["code"], headers.get_all("Link")) == (want, code, None)
        pc, _ = await _offer()  # the answer tells them too
        try:
            status, headers, _ = await _post_offer(
                ice_server, info.session_id, info.viewer_token, pc.localDescription.sdp
            )
            assert (status, headers.get_all("Link")) == (201, [stun, turn])
        finally:
            await pc.close()
        for _ in range(2):
            await host.next_chunk(timeout=10)
        await host.close()


async def test_the_python_client_gathers_with_the_ice_servers_its_server_tells(ice_server: RunningServer) -> None:
    """``WebRTCWorldClient`` made without ICE servers asks the server for its own (OPTIONS, Link headers), as the
    TypeScript package does; none of them answers here, so the world comes over host candidates."""
    from worldserve.ice import IceServer
    from worldserve.webrtc_client import WebRTCWorldClient

    async with WebRTCWorldClient(ice_server.ws) as client:
        await client.start(seed=3)
        chunk = await client.next_chunk(timeout=30)
        assert chunk.frames.shape[0] == 4
        assert client._link is not None
        servers = client._link.pc._RTCPeerConnection__configuration.iceServers  # pinned aiortc keeps it to itself
        assert [IceServer(s.urls, s.username, s.credential) for s in servers] == [
            IceServer("stun:127.0.0.1:3478"),
            IceServer("turn:127.0.0.1:3478?transport=tcp", "ana", 's3"cret'),
        ]
        await client.close()
