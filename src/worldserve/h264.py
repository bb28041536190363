"""H.264 in fragmented MP4 (fMP4) for the wire: one session's encoder stream, and its decoder.

Owns: :class:`H264Encoder` -- one session's encoder (PyAV's libx264: yuv420p, no B-frames,
``tune=zerolatency``, so every frame in gives one packet out at once) that turns each chunk
into exactly one fMP4 fragment (``moof`` + ``mdat``) holding that chunk's frames and no
other, and makes a chunk start with an IDR frame when asked (:meth:`H264Encoder.keyframe`),
on its first chunk, and every ``keyframe_interval_s``; a fragment that starts with an IDR
carries the stream's init segment (``ftyp`` + ``moov``) beside it, so whoever starts there
(a late joiner, a viewer that skipped chunks, a resumed connection) has all it needs.
:class:`H264Decoder` -- the other end: init segment and fragments back to
``uint8 [frames, height, width, 3]`` (the Python client, tests, benchmarks).
:func:`h264_settings` -- the encoder settings a session's options and frame size imply
(constant quality from ``quality``, capped at a per-resolution bitrate unless one is given).
:func:`access_units` -- a fragment's frames as Annex B access units (start codes; an IDR frame led
by the stream's SPS and PPS), what an RTP packetiser takes: a WebRTC track sends the stream
encoded once per world without encoding it again.

Why a short-lived muxer per chunk: libavformat's mp4 muxer writes a fragment only when the
*next* packet arrives (``frag_every_frame``) or when told to flush (``av_write_frame(NULL)``,
which PyAV does not expose), so a long-lived muxer would hold each chunk's last frame back
until the next chunk (vllm-omni's stream has that one-frame lag). Here the chunk's packets
go to an mp4 muxer that is closed at once (``frag_custom``: one fragment at close;
``empty_moov``; ``default_base_moof``; ``frag_discont`` with timestamps not shifted, so each
fragment's decode time, ``tfdt``, continues the stream's instead of starting at 0); its
``ftyp`` + ``moov`` are the init segment (the same bytes every time: same codec
parameters), its ``moof`` + ``mdat`` the fragment, and its trailing ``mfra`` index is
dropped. The encoder itself lives for the whole session.

PyAV is imported when the first encoder or decoder is made. Must not know: sockets,
sessions, workers.
"""

from __future__ import annotations

import io
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "DEFAULT_H264_QUALITY",
    "AccessUnit",
    "H264Decoder",
    "H264Encoder",
    "H264Fragment",
    "H264Settings",
    "access_units",
    "crf_for_quality",
    "default_bitrate_kbps",
    "h264_settings",
    "split_boxes",
]

#: ``quality`` of an h264 session that names none: CRF 18 (x264's "visually near-lossless";
#: vllm-omni's muxer uses it too).
DEFAULT_H264_QUALITY = 65
#: Bits per pixel per frame of the default bitrate cap (about 1 Mbit/s at 832x480, 16 fps) ...
_DEFAULT_BITS_PER_PIXEL = 0.3
#: ... and its floor, for tiny frames (whose headers weigh more than their pixels).
_MIN_DEFAULT_KBPS = 128
#: A forced IDR frame at least this often, so that a stream can always be entered within it.
DEFAULT_KEYFRAME_INTERVAL_S = 10.0


def crf_for_quality(quality: int) -> int:
    """x264's constant rate factor for a ``quality`` in 1..100: 100 -> 0 (lossless luma), 1 -> 51."""
    return round((100 - quality) * 51 / 99)


def default_bitrate_kbps(width: int, height: int, fps: float) -> int:
    """The bitrate cap of a session that sets none: 0.15 bits per pixel per frame, at least 64 kbit/s."""
    return max(_MIN_DEFAULT_KBPS, round(width * height * fps * _DEFAULT_BITS_PER_PIXEL / 1000))


@dataclass(frozen=True, slots=True)
class H264Settings:
    """What an :class:`H264Encoder` is built with."""

    width: int
    height: int
    fps: float
    crf: int
    bitrate_kbps: int  # the VBV cap (maxrate; the buffer holds one second of it)
    keyframe_interval_s: float = DEFAULT_KEYFRAME_INTERVAL_S

    def __post_init__(self) -> None:
        if self.width % 2 or self.height % 2 or self.width <= 0 or self.height <= 0:
            raise ValueError(f"h264 (yuv420p) needs an even, positive frame size; got {self.width}x{self.height}.")
        if not 0 <= self.crf <= 51:
            raise ValueError(f"crf must be in [0, 51]; got {self.crf}.")
        if self.bitrate_kbps < 16:
            raise ValueError(f"bitrate_kbps must be at least 16; got {self.bitrate_kbps}.")
        if not self.fps > 0 or not self.keyframe_interval_s > 0:
            raise ValueError("fps and keyframe_interval_s must be positive.")


def h264_settings(width: int, height: int, fps: float, quality: int, bitrate_kbps: int | None) -> H264Settings:
    """Settings for a session: CRF from ``quality``, the cap ``bitrate_kbps`` or the per-resolution default."""
    cap = default_bitrate_kbps(width, height, fps) if bitrate_kbps is None else bitrate_kbps
    return H264Settings(width, height, fps, crf_for_quality(quality), cap)


@dataclass(frozen=True, slots=True)
class H264Fragment:
    """One chunk as fMP4: ``fragment`` (``moof`` + ``mdat``), its frame count, and whether it
    starts with an IDR frame; ``init`` (``ftyp`` + ``moov``) is set exactly when it does."""

    fragment: bytes
    frames: int
    keyframe: bool
    init: bytes = b""


@dataclass(frozen=True, slots=True)
class AccessUnit:
    """One frame of an H.264 stream in Annex B (NAL units after start codes); ``idr``: a decoder may start here
    (it carries the SPS and PPS in front of its IDR slice)."""

    data: bytes
    idr: bool


def access_units(init: bytes, fragment: bytes) -> list[AccessUnit]:
    """The frames of ``fragment`` (``moof`` + ``mdat`` of the stream whose init segment is ``init``), in order, as
    Annex B access units: the container's length-prefixed NAL units given start codes by FFmpeg's
    ``h264_mp4toannexb``, which puts the init's SPS and PPS in front of each IDR frame."""
    import av
    from av.bitstream import BitStreamFilterContext

    units: list[AccessUnit] = []
    with av.open(io.BytesIO(init + fragment), mode="r", format="mp4") as container:
        stream = container.streams.video[0]
        annexb = BitStreamFilterContext("h264_mp4toannexb", in_stream=stream)
        for packet in container.demux(stream):
            if packet.size == 0:
                continue
            for out in annexb.filter(packet):
                data = bytes(out)
                units.append(AccessUnit(data, _IDR in _nal_types(data)))
    return units


_IDR = 5


def _nal_types(data: bytes) -> set[int]:
    """The types of the NAL units in Annex B ``data``."""
    types = set()
    at = data.find(b"\x00\x00\x01")
    while at >= 0 and at + 3 < len(data):
        types.add(data[at + 3] & 0x1F)
        at = data.find(b"\x00\x00\x01", at + 3)
    return types


def split_boxes(data: bytes) -> list[tuple[str, bytes]]:
    """The top-level ISO-BMFF boxes of ``data`` as ``(type, bytes)`` (sizes 0 and 1 included)."""
    boxes = []
    offset = 0
    while offset < len(data):
        if offset + 8 > len(data):
            raise ValueError(f"truncated box header at byte {offset}.")
        size, kind = struct.unpack(">I4s", data[offset : offset + 8])
        if size == 1:
            if offset + 16 > len(data):
                raise ValueError(f"truncated large box header at byte {offset}.")
            (size,) = struct.unpack(">Q", data[offset + 8 : offset + 16])
        elif size == 0:
            size = len(data) - offset
        if size < 8 or offset + size > len(data):
            raise ValueError(f"box {kind!r} at byte {offset} has a bad size {size}.")
        boxes.append((kind.decode("latin-1"), data[offset : offset + size]))
        offset += size
    return boxes


class H264Encoder:
    """One session's H.264 stream: :meth:`encode` one chunk's frames -> one :class:`H264Fragment`."""

    def __init__(self, settings: H264Settings) -> None:
        import av
        from av.codec.context import Flags

        self.settings = settings
        self._rate = Fraction(settings.fps).limit_denominator(10000)
        # The encoder's stream lives in a container that is never written to: it gives the codec
        # parameters (with the SPS/PPS as extradata: a global header, as mp4 needs) a template.
        holder = av.open(io.BytesIO(), mode="w", format="mp4")
        self._holder: Any = holder
        stream = holder.add_stream("libx264", rate=self._rate)
        context = stream.codec_context
        context.width = settings.width
        context.height = settings.height
        context.pix_fmt = "yuv420p"
        context.max_b_frames = 0
        context.flags |= Flags.global_header
        kbps = settings.bitrate_kbps
        context.options = {
            "preset": "ultrafast",
            "tune": "zerolatency",
            "crf": str(settings.crf),
            "maxrate": f"{kbps}k",
            "bufsize": f"{kbps}k",
            "forced-idr": "1",
            "threads": "1",
            # IDR frames only where this class puts them: at the start of a chunk.
            "x264-params": "keyint=infinite:scenecut=0",
        }
        context.open()
        holder.start_encoding()
        self._stream = stream
        self._context = context
        self._next_pts = 0
        self._since_key_s = math.inf  # the first chunk starts with an IDR frame
        self._want_key = True
        self._init: bytes | None = None

    def keyframe(self) -> None:
        """Start the next chunk with an IDR frame (and send the init segment with it)."""
        self._want_key = True

    def encode(self, frames: npt.NDArray[np.uint8]) -> H264Fragment:
        """Encode one chunk (``uint8 [frames, height, width, 3]``) into one fragment."""
        import av
        from av.video.frame import PictureType

        settings = self.settings
        if frames.ndim != 4 or frames.shape[1:] != (settings.height, settings.width, 3) or frames.dtype != np.uint8:
            raise ValueError(
                f"frames must be uint8 [n, {settings.height}, {settings.width}, 3]; got {frames.dtype} {frames.shape}."
            )
        if len(frames) == 0:
            raise ValueError("a chunk needs at least one frame.")
        key = self._want_key or self._since_key_s >= settings.keyframe_interval_s
        packets: list[Any] = []
        for index, pixels in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
            frame.pts = self._next_pts + index
            frame.time_base = 1 / self._rate
            if index == 0 and key:
                frame.pict_type = PictureType.I
            packets.extend(self._stream.encode(frame))
        if len(packets) != len(frames):  # zerolatency, no B-frames: one packet per frame, at once
            raise RuntimeError(f"the encoder gave {len(packets)} packets for {len(frames)} frames.")
        if key and not packets[0].is_keyframe:
            raise RuntimeError("the encoder did not start the chunk with an IDR frame.")
        for packet in packets:
            packet.duration = 1
        init, fragment = self._mux(packets)
        self._next_pts += len(frames)
        if key:
            self._want_key = False
            self._since_key_s = 0.0
        self._since_key_s += len(frames) / settings.fps
        return H264Fragment(fragment, len(frames), key, init if key else b"")

    def rollback(self, frames: int) -> None:
        """The last chunk (``frames`` frames) was never delivered: the next chunk starts with an IDR
        frame (so nothing refers to the lost one), at the lost chunk's place on the timeline."""
        self._next_pts = max(0, self._next_pts - frames)
        self._want_key = True

    def _mux(self, packets: Sequence[Any]) -> tuple[bytes, bytes]:
        import av

        buffer = io.BytesIO()
        muxer = av.open(
            buffer,
            mode="w",
            format="mp4",
            options={
                "movflags": "+frag_custom+empty_moov+default_base_moof+frag_discont",
                "avoid_negative_ts": "disabled",
            },
        )
        try:
            stream = muxer.add_stream_from_template(self._stream)
            for packet in packets:
                packet.stream = stream
                muxer.mux(packet)
        finally:
            muxer.close()
        init, fragment = [], []
        for kind, box in split_boxes(buffer.getvalue()):
            if kind in ("ftyp", "moov"):
                init.append(box)
            elif kind in ("moof", "mdat"):
                fragment.append(box)
        if self._init is None:
            self._init = b"".join(init)
        return self._init, b"".join(fragment)

    def close(self) -> None:
        """Free the encoder (idempotent)."""
        holder, self._holder = self._holder, None
        if holder is not None:
            holder.close()


class H264Decoder:
    """Decodes one stream's chunks in order: :meth:`decode` takes an init segment (on the first
    chunk, and whenever the stream starts again) and a fragment; returns the fragment's frames."""

    def __init__(self) -> None:
        self._init: bytes | None = None
        self._decoder: Any = None

    @property
    def ready(self) -> bool:
        """True once an init segment and a keyframe have been seen."""
        return self._decoder is not None

    def decode(self, fragment: bytes, init: bytes = b"") -> npt.NDArray[np.uint8]:
        """The frames of ``fragment``; ``init`` (re)starts the stream (the fragment must then start
        with an IDR frame). Raises ``ValueError`` for a fragment without a stream to continue."""
        import av

        if init:
            self._init = init
            self._decoder = None
        if self._init is None:
            raise ValueError("an h264 stream must start with its init segment.")
        frames: list[npt.NDArray[np.uint8]] = []
        with av.open(io.BytesIO(self._init + fragment), mode="r", format="mp4") as container:
            stream = container.streams.video[0]
            fresh = self._decoder is None
            if fresh:
                decoder = av.CodecContext.create(stream.codec_context.name, "r")
                decoder.extradata = stream.codec_context.extradata
                decoder.thread_count = 1  # a chunk's few frames: threads cost more than they save, and jitter
                self._decoder = decoder
            for packet in container.demux(stream):
                if packet.size == 0:
                    continue
                if fresh and not frames and not packet.is_keyframe:
                    self._decoder = None
                    raise ValueError("a new h264 stream must start with an IDR frame.")
                for frame in self._decoder.decode(packet):
                    frames.append(frame.to_ndarray(format="rgb24"))
        if not frames:
            raise ValueError("the fragment held no decodable frame.")
        return np.stack(frames)
