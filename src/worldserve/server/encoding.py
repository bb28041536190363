"""The server's image codecs: decoding a client's start and reference images; frame encoding is re-exported.

Owns: :func:`decode_start_image`, :func:`decode_references`. Frames are encoded by
:func:`worldserve.media.encode_frames` (JPEG via Pillow, or raw RGB), which a worker may run
instead (``--encode-frames``); it is re-exported here for the server's callers. Encoding is CPU work, so the server
calls it through ``asyncio.to_thread``, never on the loop.

Must not know: sockets, sessions.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from collections.abc import Mapping

import numpy as np
from PIL import Image, UnidentifiedImageError

from worldserve.media import encode_frames
from worldserve.models.base import ModelSpec

__all__ = ["MAX_REFERENCE_PIXELS", "decode_reference_image", "decode_references", "decode_start_image", "encode_frames"]

#: The largest reference image decoded (it is resized anyway): 4096 x 4096.
MAX_REFERENCE_PIXELS = 4096 * 4096


def decode_start_image(data: str, height: int, width: int) -> bytes:
    """Decode a base64 start image (PNG/JPEG, or raw RGB of the exact size) to raw RGB bytes.

    Raises ``ValueError`` saying what is wrong (encoding, format or size).
    """
    return _decode("image", data, height, width, resize=False)


def decode_reference_image(name: str, data: str, side: int) -> bytes:
    """Decode reference image ``name`` (base64 PNG/JPEG of any size up to :data:`MAX_REFERENCE_PIXELS`,
    or raw RGB of ``side`` squared) to raw RGB of ``side`` x ``side``: resized as ABot-World's
    pipeline resizes its reference images (``PIL.Image.resize`` to the square, its default filter).

    Raises ``ValueError`` naming the image and what is wrong.
    """
    return _decode(f"reference image {name!r}", data, side, side, resize=True)


def decode_references(images: Mapping[str, str], spec: ModelSpec) -> tuple[bytes, ...]:
    """A start's reference images, by slot name, as raw RGB in ``spec.reference_slots``' order.

    Raises ``ValueError`` when the model takes none, when a slot is missing or unknown (all or
    none: the model's pipeline falls back to no references at all when one is missing), or when
    an image cannot be decoded.
    """
    slots = spec.reference_slots
    if not slots:
        raise ValueError(f"model {spec.name!r} takes no reference images.")
    unknown = sorted(set(images) - set(slots))
    missing = [name for name in slots if name not in images]
    if unknown or missing:
        said = [f"missing {', '.join(missing)}" if missing else "", f"unknown {', '.join(unknown)}" if unknown else ""]
        raise ValueError(
            f"model {spec.name!r} takes reference images {', '.join(slots)}, all of them or none; "
            f"{'; '.join(part for part in said if part)}."
        )
    return tuple(decode_reference_image(name, images[name], spec.reference_size) for name in slots)


def _decode(what: str, data: str, height: int, width: int, *, resize: bool) -> bytes:
    try:
        blob = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} must be base64.") from None
    if len(blob) == height * width * 3:
        return blob
    try:
        # Opening reads only the header; its size is checked before a single pixel is decoded.
        # A header claiming a huge image (a decompression bomb) is refused by Pillow right there.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(blob), formats=("PNG", "JPEG"))
        with image:
            if resize:
                if image.size[0] * image.size[1] > MAX_REFERENCE_PIXELS:
                    raise ValueError(f"{what} is {image.size[0]}x{image.size[1]}; at most 4096x4096 is decoded.")
                return np.asarray(image.convert("RGB").resize((width, height)), dtype=np.uint8).tobytes()
            if image.size != (width, height):
                raise ValueError(f"{what} must be {width}x{height}; got {image.size[0]}x{image.size[1]}.")
            return np.asarray(image.convert("RGB"), dtype=np.uint8).tobytes()
    except Image.DecompressionBombError:
        raise ValueError(
            f"{what} must be {width}x{height}; its header claims an image too large to decode (a decompression bomb)."
        ) from None
    except (UnidentifiedImageError, OSError, SyntaxError):
        raise ValueError(
            f"{what} is neither PNG, JPEG nor raw RGB of {width}x{height} ({height * width * 3} bytes)."
        ) from None
