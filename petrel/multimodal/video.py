"""Videos from callers: encoded bytes decoded once with PyAV and sampled to frames (fps frames per second, as
transformers' Qwen2-VL video processor samples them), or frames given already (a list of PIL images or an array
[frames, height, width, 3]); each checked against the limits, each failure a ValueError naming the item."""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass

from petrel.multimodal.media import DEFAULT_MAX_IMAGE_PIXELS, error_text, load_image

DEFAULT_MAX_VIDEO_BYTES = 200 * 1024 * 1024  # one encoded video
DEFAULT_MAX_FRAMES = 768  # sampled frames of one video (transformers' Qwen2-VL default)
MIN_FRAMES = 4


class _Refused(ValueError):
    """A check of ours inside the decoding block (PyAV's own errors are ValueErrors too, and get the name added)."""


@dataclass(frozen=True, eq=False)
class Video:
    """A video's sampled frames (PIL images, RGB, one size) and the rate they were sampled at (frames / second)."""

    frames: tuple
    fps: float

    def hash(self, processor_digest: bytes) -> bytes:
        """The content hash of the sampled frames under one processor configuration."""
        h = hashlib.sha256(b"video:" + processor_digest + f"{self.fps!r}:{len(self.frames)}:".encode())
        for frame in self.frames:
            h.update(f"{frame.mode}:{frame.size[0]}x{frame.size[1]}:".encode())
            h.update(frame.tobytes())
        return h.digest()


def sample_indices(total: int, video_fps: float, fps: float, temporal_patch: int, max_frames: int) -> list[int]:
    """Frame indices sampled at `fps` from `total` frames at `video_fps`: a multiple of temporal_patch frames,
    at least MIN_FRAMES (when the video has them), at most max_frames, spread evenly (transformers' sample_frames)."""
    most = math.floor(min(max_frames, total) / temporal_patch) * temporal_patch
    n = min(max(total / video_fps * fps, MIN_FRAMES), most, total)
    n = math.floor(n / temporal_patch) * temporal_patch
    if n < 1:
        return list(range(total))  # shorter than one temporal patch: every frame (the last is repeated to fill it)
    step = total / n
    return [int(i * step) for i in range(n)]  # float steps truncated, as torch.arange(...).int() gives them


def load_video(
    value,
    name: str,
    fps: float = 2.0,
    temporal_patch: int = 2,
    max_frames: int = DEFAULT_MAX_FRAMES,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    max_bytes: int = DEFAULT_MAX_VIDEO_BYTES,
) -> Video:
    """A Video from encoded bytes (sampled at fps) or from frames given as they are (taken to be at fps)."""
    if isinstance(value, Video):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _decode(bytes(value), name, fps, temporal_patch, max_frames, max_pixels, max_bytes)
    if hasattr(value, "shape") and len(value.shape) == 4:  # an array of frames [T, H, W, 3]
        value = list(value)
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(
            f"{name} must be encoded video bytes, a non-empty list of frames (PIL images) or an array "
            f"[frames, height, width, 3], got {type(value).__name__}"
        )
    if len(value) > max_frames:
        raise ValueError(f"{name}: {len(value)} frames, over the limit of {max_frames}")
    frames = tuple(
        load_image(_frame(f, f"{name}.frames[{i}]"), f"{name}.frames[{i}]", max_pixels).convert("RGB")
        for i, f in enumerate(value)
    )
    if len({f.size for f in frames}) > 1:
        raise ValueError(f"{name}: the frames differ in size")
    return Video(frames, float(fps))


def _frame(frame, name: str):
    """A frame as load_image takes it: an array [height, width, 3] of uint8 becomes a PIL image."""
    if not hasattr(frame, "shape"):
        return frame
    import numpy as np
    from PIL import Image

    array = np.asarray(frame)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(f"{name} must be uint8 [height, width, 3], got {array.dtype} {list(array.shape)}")
    return Image.fromarray(array)


def _decode(data: bytes, name, fps, temporal_patch, max_frames, max_pixels, max_bytes) -> Video:
    try:
        import av
    except ImportError:
        raise ValueError(f"{name}: decoding videos needs PyAV: pip install 'petrel[vision]'") from None
    if len(data) > max_bytes:
        raise ValueError(f"{name}: the video is {len(data)} bytes, over the limit of {max_bytes}")
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise _Refused(f"{name}: not a video (no video stream)")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > max_pixels:
                raise _Refused(f"{name}: the frames are {width}x{height} pixels, over the limit of {max_pixels}")
            rate = float(stream.average_rate or stream.guessed_rate or 0) or fps
            total = stream.frames
            if total <= 0:  # the container does not say: count them (decoding nothing but the packets' frames)
                total = sum(1 for _ in container.decode(stream))
                container.seek(0)
            wanted = set(sample_indices(total, rate, fps, temporal_patch, max_frames))
            frames = []
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    frames.append(frame.to_image().convert("RGB"))
                if len(frames) == len(wanted):
                    break
    except _Refused:
        raise
    except Exception as exc:  # PyAV's errors (av.error.*) and malformed streams
        raise ValueError(f"{name}: not a decodable video ({type(exc).__name__}: {error_text(exc)})") from None
    if not frames:
        raise ValueError(f"{name}: the video has no frames")
    if len({f.size for f in frames}) > 1:
        raise ValueError(f"{name}: the frames differ in size")
    return Video(tuple(frames), float(fps))
