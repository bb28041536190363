"""Frame encoding for the wire, wherever it runs: in a worker (the runner) or in the server.

Owns: :class:`FrameEncoding` (the media and JPEG quality a session asked for),
:class:`EncodedFrames` (one chunk's frames as one payload per frame, with their size),
:func:`encode_frames` (``uint8 [frames, height, width, 3]`` -> JPEG via Pillow, whose
libjpeg-turbo output is identical for identical input, or raw RGB bytes) and
:func:`decode_frames` (back to an array: for tests, and for the rare chunk whose payloads
were made for another encoding). Encoding is CPU work: the server calls it through
``asyncio.to_thread``; a runner calls it right after ``model.step``.

Pillow is imported on the first JPEG (so the encoding value itself, which
:class:`~worldserve.models.SessionOptions` carries, costs nothing to import).
Must not know: sockets, sessions, workers.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["MEDIA", "EncodedFrames", "FrameEncoding", "decode_frames", "encode", "encode_frames"]

#: The media a chunk's frames can be sent as.
MEDIA = ("jpeg", "raw")


@dataclass(frozen=True, slots=True)
class FrameEncoding:
    """How a session's frames are to be sent: ``media`` ("jpeg" or "raw") and JPEG ``quality`` (1..100)."""

    media: str = "jpeg"
    quality: int = 90

    def __post_init__(self) -> None:
        if self.media not in MEDIA:
            raise ValueError(f"unknown media {self.media!r}; expected one of {list(MEDIA)}.")
        if isinstance(self.quality, bool) or not isinstance(self.quality, int) or not 1 <= self.quality <= 100:
            raise ValueError(f"quality must be an integer in [1, 100]; got {self.quality!r}.")

    def same_bytes(self, other: FrameEncoding) -> bool:
        """True when both make the same payloads (raw ignores the quality)."""
        return self.media == other.media and (self.media == "raw" or self.quality == other.quality)


@dataclass(frozen=True, slots=True)
class EncodedFrames:
    """One chunk's frames, encoded: one payload per frame, each ``width`` x ``height``."""

    encoding: FrameEncoding
    width: int
    height: int
    payloads: tuple[bytes, ...]

    @property
    def count(self) -> int:
        return len(self.payloads)

    @property
    def nbytes(self) -> int:
        """The payloads' bytes (what crosses a machine boundary)."""
        return sum(len(payload) for payload in self.payloads)


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
    raise ValueError(f"unknown media {media!r}; expected 'jpeg' or 'raw'.")


def encode(frames: npt.NDArray[np.uint8], encoding: FrameEncoding) -> EncodedFrames:
    """``frames`` as :class:`EncodedFrames` in ``encoding``."""
    payloads = encode_frames(frames, encoding.media, encoding.quality)
    return EncodedFrames(encoding, int(frames.shape[2]), int(frames.shape[1]), tuple(payloads))


def decode_frames(encoded: EncodedFrames) -> npt.NDArray[np.uint8]:
    """The frames back as ``uint8 [frames, height, width, 3]`` (JPEG: within its loss)."""
    shape = (encoded.height, encoded.width, 3)
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
