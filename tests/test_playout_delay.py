"""The playout-delay extension at zero on the server's video (playout_delay.py): answered where an offer has it (as
Chromium's does), never where it does not, and then carried by every video packet beside aiortc's own extensions."""

from __future__ import annotations

import pytest

aiortc = pytest.importorskip("aiortc")

from worldserve.playout_delay import PLAYOUT_DELAY_URI, ZERO_DELAY, use_zero_playout_delay  # noqa: E402


async def _answer(offer_keeps_delay: bool) -> str:
    """An aiortc server (as worldserve's) answers a video offer with a track to send: the answer's SDP."""
    from aiortc.mediastreams import VideoStreamTrack

    use_zero_playout_delay()
    client = aiortc.RTCPeerConnection()
    server = aiortc.RTCPeerConnection()
    try:
        client.addTransceiver("video", direction="recvonly")
        await client.setLocalDescription(await client.createOffer())
        offer = client.localDescription.sdp
        assert f" {PLAYOUT_DELAY_URI}\r\n" in offer  # this process's aiortc offers it too now
        if not offer_keeps_delay:
            offer = "".join(line for line in offer.splitlines(keepends=True) if PLAYOUT_DELAY_URI not in line)
        await server.setRemoteDescription(aiortc.RTCSessionDescription(sdp=offer, type="offer"))
        server.addTrack(VideoStreamTrack())
        await server.setLocalDescription(await server.createAnswer())
        return str(server.localDescription.sdp)
    finally:
        await server.close()
        await client.close()


async def test_the_extension_is_answered_only_where_the_offer_has_it() -> None:
    answered = await _answer(offer_keeps_delay=True)
    assert f"a=extmap:4 {PLAYOUT_DELAY_URI}\r\n" in answered
    assert PLAYOUT_DELAY_URI not in await _answer(offer_keeps_delay=False)


def test_every_video_packet_carries_zero_delay_where_negotiated_beside_the_other_extensions() -> None:
    from aiortc.rtcrtpparameters import RTCRtpHeaderExtensionParameters, RTCRtpParameters
    from aiortc.rtp import HeaderExtensions, HeaderExtensionsMap, RtpPacket, unpack_header_extensions

    use_zero_playout_delay()
    use_zero_playout_delay()  # once is enough: a second call changes nothing
    mid = RTCRtpHeaderExtensionParameters(id=9, uri="urn:ietf:params:rtp-hdrext:sdes:mid")
    delay = RTCRtpHeaderExtensionParameters(id=5, uri=PLAYOUT_DELAY_URI)
    for negotiated, expected in (([mid, delay], [(9, b"0"), (5, ZERO_DELAY)]), ([mid], [(9, b"0")])):
        extensions_map = HeaderExtensionsMap()
        extensions_map.configure(RTCRtpParameters(headerExtensions=negotiated))
        packet = RtpPacket(payload_type=96, sequence_number=1, timestamp=90, payload=b"frame")
        packet.extensions = HeaderExtensions(mid="0")
        data = packet.serialize(extensions_map)
        assert data[0] & 0x10  # the extension bit; its header follows the fixed 12 bytes (no CSRC)
        profile, words = int.from_bytes(data[12:14]), int.from_bytes(data[14:16])
        assert unpack_header_extensions(profile, data[16 : 16 + 4 * words]) == expected
        parsed = RtpPacket.parse(data, extensions_map)
        assert parsed.extensions.mid == "0"  # aiortc's own extension, read back as before
        assert parsed.payload == b"frame"
