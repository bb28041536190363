"""The server's image codecs: decoding a client's start image; frame encoding is re-exported.

Owns: :func:`decode_start_image`. Frames are encoded by :func:`worldserve.media.encode_frames`
(JPEG via Pillow, or raw RGB), which a worker may run instead (``--encode-frames``);
it is re-exported here for the server's callers. Encoding is CPU work, so the server
calls it through ``asyncio.to_thread``, never on the loop.

Must not know: sockets, sessions.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError

from worldserve.media import encode_frames

__all__ = ["decode_start_image", "encode_frames"]


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
