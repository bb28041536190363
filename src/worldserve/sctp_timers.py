"""aiortc's data channel (SCTP) retransmission timers, set as libwebrtc sets its own.

aiortc keeps RFC 4960's defaults: a retransmission timeout (RTO) of at least 1 s, 3 s before the first round trip
is measured. On an ordered channel a lost packet holds every message behind it that long: across a link with 40 ms
round trips and 1 % loss, chunk headers, ``chunk.track``, inputs and acks stalled for a second and more, and a
session over WebRTC showed 4.5 of its 16 frames/s (``bench/webrtc_latency.py``, docs/latency.md). libwebrtc's SCTP
(dcsctp, what Chromium's data channels run) takes 220 ms at least, 800 ms at most and 500 ms to begin, so the timer
waits out a slow acknowledgement without holding a realtime stream for seconds; worldserve sets aiortc's the same,
on each end it runs (the server, :class:`~worldserve.webrtc_client.WebRTCWorldClient`).

Owns: those three numbers. Must not know: anything of sessions.
"""

from __future__ import annotations

__all__ = ["RTO_INITIAL_S", "RTO_MAX_S", "RTO_MIN_S", "use_libwebrtc_timers"]

RTO_MIN_S = 0.22
RTO_MAX_S = 0.8
RTO_INITIAL_S = 0.5


def use_libwebrtc_timers() -> None:
    """Set aiortc's SCTP timers (module settings, read as each association starts and as its RTO is updated) to
    libwebrtc's; this process's data channels from then on use them. Needs the ``webrtc`` extra."""
    import aiortc.rtcsctptransport as sctp

    sctp.SCTP_RTO_MIN = RTO_MIN_S  # type: ignore[assignment]
    sctp.SCTP_RTO_MAX = RTO_MAX_S  # type: ignore[assignment]
    sctp.SCTP_RTO_INITIAL = RTO_INITIAL_S
