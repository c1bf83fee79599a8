"""Images from callers: PIL images as they are, encoded bytes decoded once with Pillow; each checked against the
limits before anything is decoded, and each failure a ValueError naming the item."""

from __future__ import annotations

import hashlib
import io
import re
import warnings

DEFAULT_MAX_IMAGE_PIXELS = 40_000_000  # width x height of one image (a 12 MP photo is well inside)
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one encoded image
_OBJECT_REPR = re.compile(r"\s*<[\w.]+ object at 0x[0-9a-fA-F]+>")  # Pillow names its file by repr
_MODES = {"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "I", "I;16", "F"}  # convertible to RGB


def load_image(value, name: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES):
    """A PIL image (given, or decoded from bytes), checked: a mode that converts to RGB, at most max_pixels pixels,
    at most max_bytes encoded bytes. ValueError naming `name` otherwise."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, (bytes, bytearray, memoryview)):
        if len(value) > max_bytes:
            raise ValueError(f"{name}: the image is {len(value)} bytes, over the limit of {max_bytes}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the pixel budget is checked below
                image = Image.open(io.BytesIO(bytes(value)))
        except Image.DecompressionBombError as exc:
            raise ValueError(f"{name}: the image is over the pixel budget ({error_text(exc)})") from None
        except UnidentifiedImageError:
            raise ValueError(f"{name}: not a decodable image (no image format Pillow reads)") from None
        except (OSError, ValueError) as exc:
            raise ValueError(f"{name}: not a decodable image ({error_text(exc)})") from None
        _check_size(image, name, max_pixels)  # from the header, before the pixels are decoded
        try:
            image.load()
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            raise ValueError(f"{name}: the image could not be decoded ({error_text(exc)})") from None
    elif isinstance(value, Image.Image):
        image = value
    else:
        raise ValueError(f"{name} must be a PIL image or encoded image bytes, got {type(value).__name__}")
    _check_size(image, name, max_pixels)
    if image.mode not in _MODES:
        raise ValueError(f"{name}: image mode {image.mode!r} is not supported (supported: {', '.join(sorted(_MODES))})")
    return image


def error_text(exc: Exception) -> str:
    """A decoder's message without object reprs (`<_io.BytesIO object at 0x7f...>`: a heap address)."""
    return _OBJECT_REPR.sub("", str(exc))


def _check_size(image, name: str, max_pixels: int) -> None:
    width, height = image.size
    if width < 1 or height < 1:
        raise ValueError(f"{name}: the image is empty ({width}x{height})")
    if width * height > max_pixels:
        raise ValueError(f"{name}: the image is {width}x{height} pixels, over the limit of {max_pixels} pixels")


def image_hash(image, processor_digest: bytes) -> bytes:
    """The content hash of a decoded image under one processor configuration: the same picture given as bytes or
    as a PIL image hashes the same."""
    h = hashlib.sha256(b"image:" + processor_digest)
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.digest()
