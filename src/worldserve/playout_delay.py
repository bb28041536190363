"""The RTP playout-delay extension, at zero, on the video aiortc sends: a browser shows each frame as it is decoded.

A browser's WebRTC receiver (libwebrtc's) holds decoded frames back to play them smoothly: its jitter buffer sets a
playout delay from the jitter and the retransmissions it sees, and across a lossy link it grows (the page's key-to-
photon ``transfer`` read 110 ms at 1 % loss where worldserve's own client read 74: docs/latency.md). A sender may
ask for less with the ``playout-delay`` header extension (``http://www.webrtc.org/experiments/rtp-hdrext/playout-delay``:
a minimum and a maximum delay, 12 bits each in 10 ms units); at zero and zero, libwebrtc renders each frame as soon
as it is decoded, as cloud-gaming services ask of it. A world made for a person steering it wants that: its frames
are already paced at the model's rate by the sender (:class:`~worldserve.server.webrtc.FrameTrack`).

aiortc knows no such extension. :func:`use_zero_playout_delay` adds it: to the video extensions aiortc answers with
where an offer has it (Chromium's do), and, where negotiated, to every video packet it sends.

Owns: the extension's URI and its value. Must not know: sessions, tracks.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PLAYOUT_DELAY_URI", "ZERO_DELAY", "use_zero_playout_delay"]

PLAYOUT_DELAY_URI = "http://www.webrtc.org/experiments/rtp-hdrext/playout-delay"
#: Minimum 0, maximum 0 (two 12-bit numbers of 10 ms): render each frame as it is decoded.
ZERO_DELAY = b"\x00\x00\x00"
_LOCAL_ID = 4  # in aiortc's own offers (its other video extensions are 1 and 3); an answer takes the offer's id


def use_zero_playout_delay() -> None:
    """Make this process's aiortc negotiate the playout-delay extension for video and send it at zero on every video
    packet where negotiated (idempotent). Needs the ``webrtc`` extra."""
    import aiortc.codecs as codecs
    import aiortc.rtp as rtp
    from aiortc.rtcrtpparameters import RTCRtpHeaderExtensionParameters

    video = codecs.HEADER_EXTENSIONS["video"]
    if not any(extension.uri == PLAYOUT_DELAY_URI for extension in video):
        video.append(RTCRtpHeaderExtensionParameters(id=_LOCAL_ID, uri=PLAYOUT_DELAY_URI))
    extensions_map: Any = rtp.HeaderExtensionsMap
    if getattr(extensions_map, "_worldserve_playout_delay", False):
        return
    configure, values_to_bytes = extensions_map.configure, extensions_map.set

    def configure_with_delay(self: Any, parameters: Any) -> None:
        configure(self, parameters)
        ids = [extension.id for extension in parameters.headerExtensions if extension.uri == PLAYOUT_DELAY_URI]
        self._worldserve_delay_id = ids[0] if ids else None

    def set_with_delay(self: Any, values: Any) -> tuple[int, bytes]:
        profile, value = values_to_bytes(self, values)
        delay_id = getattr(self, "_worldserve_delay_id", None)
        if delay_id is None:
            return profile, value
        extensions = rtp.unpack_header_extensions(profile, value)
        return rtp.pack_header_extensions([*extensions, (delay_id, ZERO_DELAY)])

    extensions_map.configure = configure_with_delay
    extensions_map.set = set_with_delay
    extensions_map._worldserve_playout_delay = True
