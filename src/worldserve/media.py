"""Frame encoding for the wire, wherever it runs: in a worker (the runner) or in the server.

Owns: :class:`FrameEncoding` (the media, quality and, for H.264, bitrate cap a session asked
for), :class:`EncodedFrames` (one chunk's frames as payloads: one per frame for JPEG and raw,
one fMP4 fragment for H.264, with the stream's init segment on a keyframe; a chunk wanted in
several media carries the others as ``alternates``),
:class:`FrameEncoder` (one session's encoder: JPEG and raw are stateless, H.264 is a stream
with its own state, :class:`~worldserve.h264.H264Encoder`), :func:`encode_frames`
(``uint8 [frames, height, width, 3]`` -> JPEG via Pillow, whose libjpeg-turbo output is
identical for identical input, or raw RGB bytes) and :func:`decode_frames` (back to an
array: for tests, and for the rare chunk whose payloads were made for another encoding).
Encoding is CPU work: the server calls it through ``asyncio.to_thread``; a runner calls it
right after ``model.step``.

Pillow is imported on the first JPEG and PyAV on the first H.264 chunk (so the encoding
value itself, which :class:`~worldserve.models.SessionOptions` carries, costs nothing to
import). Must not know: sockets, sessions, workers.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from worldserve.h264 import H264Encoder

__all__ = [
    "DEFAULT_QUALITY",
    "MEDIA",
    "EncodedFrames",
    "FrameEncoder",
    "FrameEncoding",
    "decode_frames",
    "encode",
    "encode_frames",
]

#: The media a chunk's frames can be sent as.
MEDIA = ("jpeg", "raw", "h264")
#: The ``quality`` of a session that names none, per media (h264: CRF 18, see :mod:`worldserve.h264`).
DEFAULT_QUALITY = {"jpeg": 90, "raw": 90, "h264": 65}


@dataclass(frozen=True, slots=True)
class FrameEncoding:
    """How a session's frames are to be sent.

    ``media``: "jpeg", "raw" or "h264". ``quality`` (1..100): JPEG's quality, or for H.264
    the constant quality it aims at (CRF ``round((100 - quality) * 51 / 99)``: 65 -> 18).
    ``bitrate_kbps`` (H.264 only): the cap on its bitrate; ``None`` takes the per-resolution
    default (:func:`worldserve.h264.default_bitrate_kbps`). :meth:`for_media` fills in the
    media's default quality.
    """

    media: str = "jpeg"
    quality: int = 90
    bitrate_kbps: int | None = None

    def __post_init__(self) -> None:
        if self.media not in MEDIA:
            raise ValueError(f"unknown media {self.media!r}; expected one of {list(MEDIA)}.")
        if isinstance(self.quality, bool) or not isinstance(self.quality, int) or not 1 <= self.quality <= 100:
            raise ValueError(f"quality must be an integer in [1, 100]; got {self.quality!r}.")
        if self.bitrate_kbps is not None:
            if self.media != "h264":
                raise ValueError(f"bitrate_kbps applies to h264 only, not {self.media}.")
            bitrate = self.bitrate_kbps
            if isinstance(bitrate, bool) or not isinstance(bitrate, int) or not 16 <= bitrate <= 100_000:
                raise ValueError(f"bitrate_kbps must be an integer in [16, 100000]; got {bitrate!r}.")

    @classmethod
    def for_media(cls, media: str, quality: int | None = None, bitrate_kbps: int | None = None) -> FrameEncoding:
        """``media`` at ``quality`` (``None``: the media's default, :data:`DEFAULT_QUALITY`)."""
        if media not in MEDIA:
            raise ValueError(f"unknown media {media!r}; expected one of {list(MEDIA)}.")
        return cls(media, DEFAULT_QUALITY[media] if quality is None else quality, bitrate_kbps)

    @property
    def stateful(self) -> bool:
        """True when a chunk's bytes depend on the chunks before it (H.264: one stream per session)."""
        return self.media == "h264"

    def same_bytes(self, other: FrameEncoding) -> bool:
        """True when both make the same payloads (raw ignores the quality)."""
        if self.media != other.media:
            return False
        return self.media == "raw" or (self.quality, self.bitrate_kbps) == (other.quality, other.bitrate_kbps)


@dataclass(frozen=True, slots=True)
class EncodedFrames:
    """One chunk's frames, encoded, each ``width`` x ``height``.

    JPEG and raw: one payload per frame. H.264: one payload, the chunk's fMP4 fragment
    (``moof`` + ``mdat``) holding ``frame_count`` frames; ``keyframe`` says it starts with
    an IDR frame, and then ``init`` holds the stream's init segment (``ftyp`` + ``moov``), which
    a receiver that starts there (or starts again) needs first.

    ``alternates``: the same chunk in other media (a world whose members asked for several:
    encoded once per media, not once per member); :meth:`versions` lists them all by media.
    """

    encoding: FrameEncoding
    width: int
    height: int
    payloads: tuple[bytes, ...]
    frame_count: int | None = None
    keyframe: bool = False
    init: bytes = b""
    alternates: tuple[EncodedFrames, ...] = ()

    def versions(self) -> dict[str, EncodedFrames]:
        """This chunk by media: itself and its ``alternates`` (each without alternates of its own)."""
        found = {self.encoding.media: replace(self, alternates=())}
        for other in self.alternates:
            found.setdefault(other.encoding.media, replace(other, alternates=()))
        return found

    @property
    def count(self) -> int:
        """Frames in the chunk."""
        return len(self.payloads) if self.frame_count is None else self.frame_count

    @property
    def nbytes(self) -> int:
        """The payloads' bytes and any init segment, alternates included (what crosses a machine boundary)."""
        own = sum(len(payload) for payload in self.payloads) + len(self.init)
        return own + sum(other.nbytes for other in self.alternates)


def encode_frames(frames: npt.NDArray[np.uint8], media: str, quality: int = 90) -> list[bytes]:
    """One wire payload per frame: JPEG bytes, or raw RGB (``height * width * 3`` bytes)."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [frames, height, width, 3]; got {frames.dtype} {frames.shape}.")
    if media == "raw":
        return [np.ascontiguousarray(frame).tobytes() for frame in frames]
    if media == "jpeg":
        from PIL import Image

        payloads = []
        for frame in frames:
            buffer = io.BytesIO()
            Image.fromarray(frame, mode="RGB").save(buffer, format="JPEG", quality=quality, subsampling=0)
            payloads.append(buffer.getvalue())
        return payloads
    raise ValueError(f"unknown media {media!r} for per-frame payloads; expected 'jpeg' or 'raw'.")


def encode(frames: npt.NDArray[np.uint8], encoding: FrameEncoding) -> EncodedFrames:
    """``frames`` as :class:`EncodedFrames` in a stateless ``encoding`` (JPEG or raw; H.264 is a
    stream: use a :class:`FrameEncoder`)."""
    if encoding.stateful:
        raise ValueError(f"{encoding.media} frames are a stream; encode them with a FrameEncoder.")
    payloads = encode_frames(frames, encoding.media, encoding.quality)
    return EncodedFrames(encoding, int(frames.shape[2]), int(frames.shape[1]), tuple(payloads))


class FrameEncoder:
    """One session's frames into ``encoding``, chunk by chunk, for a ``width`` x ``height`` stream at ``fps``.

    Stateless media (JPEG, raw) just :func:`encode`; H.264 keeps an
    :class:`~worldserve.h264.H264Encoder` (made on the first chunk). :meth:`keyframe` starts the
    next chunk with an IDR frame; :meth:`rollback` forgets the last chunk (it was never
    delivered); :meth:`close` frees the stream. Not thread-safe: one chunk at a time.
    """

    def __init__(self, encoding: FrameEncoding, width: int, height: int, fps: float) -> None:
        self.encoding = encoding
        self._size = (width, height, fps)
        self._stream: H264Encoder | None = None

    def encode(self, frames: npt.NDArray[np.uint8]) -> EncodedFrames:
        encoding = self.encoding
        if not encoding.stateful:
            return encode(frames, encoding)
        if self._stream is None:
            from worldserve.h264 import H264Encoder, h264_settings

            width, height, fps = self._size
            self._stream = H264Encoder(h264_settings(width, height, fps, encoding.quality, encoding.bitrate_kbps))
        made = self._stream.encode(frames)
        return EncodedFrames(
            encoding,
            int(frames.shape[2]),
            int(frames.shape[1]),
            (made.fragment,),
            frame_count=made.frames,
            keyframe=made.keyframe,
            init=made.init,
        )

    def keyframe(self) -> None:
        """Start the next chunk with an IDR frame (a stream that has not begun starts with one anyway)."""
        if self._stream is not None:
            self._stream.keyframe()

    def rollback(self, frames: int) -> None:
        """The last chunk of ``frames`` frames was made but never delivered: continue as if it was not."""
        if self._stream is not None:
            self._stream.rollback(frames)

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()


def decode_frames(encoded: EncodedFrames) -> npt.NDArray[np.uint8]:
    """The frames back as ``uint8 [frames, height, width, 3]`` (JPEG and H.264: within their loss).

    An H.264 chunk decodes alone only when it starts a stream (``keyframe``, with ``init``);
    a stream's other chunks need an :class:`~worldserve.h264.H264Decoder` that saw the ones before.
    """
    shape = (encoded.height, encoded.width, 3)
    if encoded.encoding.media == "h264":
        if not encoded.keyframe or not encoded.init:
            raise ValueError("an h264 chunk that does not start with a keyframe cannot be decoded alone.")
        from worldserve.h264 import H264Decoder

        return H264Decoder().decode(encoded.payloads[0], encoded.init)
    if encoded.encoding.media == "raw":
        arrays = [np.frombuffer(payload, np.uint8).reshape(shape) for payload in encoded.payloads]
    else:
        from PIL import Image

        arrays = []
        for payload in encoded.payloads:
            with Image.open(io.BytesIO(payload), formats=("JPEG",)) as image:
                arrays.append(np.asarray(image.convert("RGB"), dtype=np.uint8).reshape(shape))
    if not arrays:
        return np.zeros((0, *shape), np.uint8)
    return np.stack(arrays)
