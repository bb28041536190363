"""aiortc's data channel timers set as libwebrtc's: an association's retransmission timeout follows the round
trip down to 220 ms (aiortc's own floor is 1 s) and starts at 500 ms. Checked on aiortc's SCTP itself, so an
aiortc that stopped reading these settings would fail here."""

from __future__ import annotations

import pytest

sctp = pytest.importorskip("aiortc.rtcsctptransport")

from worldserve.sctp_timers import RTO_INITIAL_S, RTO_MAX_S, RTO_MIN_S, use_libwebrtc_timers  # noqa: E402


class _Transport:
    """Just enough of a DTLS transport for an SCTP association to be made (nothing is sent)."""

    state = "new"
    transport = None

    def _register_data_receiver(self, receiver: object) -> None:
        pass


async def test_a_data_channels_retransmission_timeout_follows_the_round_trip_down_to_libwebrtcs_floor() -> None:
    before = (sctp.SCTP_RTO_MIN, sctp.SCTP_RTO_MAX, sctp.SCTP_RTO_INITIAL)
    try:
        use_libwebrtc_timers()
        association = sctp.RTCSctpTransport(_Transport())
        assert association._rto == RTO_INITIAL_S
        for _ in range(20):
            association._update_rto(0.04)  # 40 ms round trips
        assert association._rto == pytest.approx(RTO_MIN_S)
        association._update_rto(30.0)  # one very slow round trip: capped
        assert association._rto <= RTO_MAX_S
    finally:
        sctp.SCTP_RTO_MIN, sctp.SCTP_RTO_MAX, sctp.SCTP_RTO_INITIAL = before
