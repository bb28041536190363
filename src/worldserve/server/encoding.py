"""Frame encoding for the wire: JPEG (Pillow, libjpeg-turbo inside) or raw RGB bytes.

Owns: turning a chunk's ``uint8 [frames, height, width, 3]`` array into one bytes
object per frame, and decoding a client's start image. Encoding is CPU work, so the
server calls :func:`encode_frames` through ``asyncio.to_thread``, never on the loop.

Must not know: sockets, sessions.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings

import numpy as np
import numpy.typing as npt
from PIL import Image, UnidentifiedImageError

__all__ = ["decode_start_image", "encode_frames"]


def encode_frames(frames: npt.NDArray[np.uint8], media: str, quality: int = 90) -> list[bytes]:
    """One wire payload per frame: JPEG bytes, or raw RGB (``height * width * 3`` bytes)."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [frames, height, width, 3]; got {frames.dtype} {frames.shape}.")
    if media == "raw":
        return [np.ascontiguousarray(frame).tobytes() for frame in frames]
    if media == "jpeg":
        payloads = []
        for frame in frames:
            buffer = io.BytesIO()
            Image.fromarray(frame, mode="RGB").save(buffer, format="JPEG", quality=quality, subsampling=0)
            payloads.append(buffer.getvalue())
        return payloads
    raise ValueError(f"unknown media {media!r}; expected 'jpeg' or 'raw'.")


def decode_start_image(data: str, height: int, width: int) -> bytes:
    """Decode a base64 start image (PNG/JPEG, or raw RGB of the exact size) to raw RGB bytes.

    Raises ``ValueError`` saying what is wrong (encoding, format or size).
    """
    try:
        blob = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image must be base64.") from None
    if len(blob) == height * width * 3:
        return blob
    try:
        # Opening reads only the header; its size is checked before a single pixel is decoded.
        # A header claiming a huge image (a decompression bomb) is refused by Pillow right there.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(blob), formats=("PNG", "JPEG"))
        with image:
            if image.size != (width, height):
                raise ValueError(f"image must be {width}x{height}; got {image.size[0]}x{image.size[1]}.")
            return np.asarray(image.convert("RGB"), dtype=np.uint8).tobytes()
    except Image.DecompressionBombError:
        raise ValueError(
            f"image must be {width}x{height}; its header claims an image too large to decode (a decompression bomb)."
        ) from None
    except (UnidentifiedImageError, OSError, SyntaxError):
        raise ValueError(
            f"image is neither PNG, JPEG nor raw RGB of {width}x{height} ({height * width * 3} bytes)."
        ) from None
