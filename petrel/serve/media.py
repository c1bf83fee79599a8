"""Images and videos in chat messages: each `image_url` / `video_url` content part (a data: URL, or an http(s) URL
fetched with a timeout and a byte limit unless remote media is off) decoded once and checked; every failure a 400
naming the part."""

from __future__ import annotations

import base64
import binascii
import urllib.error
import urllib.request
from dataclasses import dataclass

from petrel.multimodal.media import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, load_image
from petrel.multimodal.prompts import TEXT_ONLY
from petrel.multimodal.video import DEFAULT_MAX_VIDEO_BYTES
from petrel.serve.errors import APIError


@dataclass
class MediaLimits:
    takes_images: bool = False  # the model has an image processor
    max_images: int | None = None  # per request (--limit-mm-per-prompt image=N); None: any number
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # one image, encoded
    allow_remote: bool = True  # fetch http(s) URLs (--no-remote-media: off)
    takes_videos: bool = False  # the model's processor takes videos (video_url parts)
    max_videos: int | None = None  # per request (--limit-mm-per-prompt video=N); None: any number
    max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES  # one video, encoded
    timeout: float = 10.0  # seconds for one remote fetch


def image_parts(messages, kind: str = "image_url") -> list[tuple[str, str]]:
    """(param, url) of every `kind` content part (image_url, video_url) of the request's messages, in order."""
    parts = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type == kind:
                    url = getattr(part, kind).url if getattr(part, kind, None) is not None else None
                    if url is None:
                        raise APIError(f"a {kind} part needs {kind}.url", 400, param=f"messages.{i}.content.{j}")
                    parts.append((f"messages.{i}.content.{j}", url))
    return parts


def _check_count(parts: list[tuple[str, str]], limit: int | None, what: str) -> None:
    """A 400 naming the first part over the per-prompt limit (--limit-mm-per-prompt)."""
    if limit is not None and len(parts) > limit:
        raise APIError(
            f"{len(parts)} {what} in this request, over the limit of {limit} per prompt (--limit-mm-per-prompt)",
            400,
            param=parts[limit][0],
        )


def load_images(parts: list[tuple[str, str]], limits: MediaLimits) -> list:
    """The parts' images, decoded and checked (blocking: run it off the event loop)."""
    if parts and not limits.takes_images:
        raise APIError(TEXT_ONLY, 400, param=f"{parts[0][0]}.type")
    _check_count(parts, limits.max_images, "images")
    images = []
    for param, url in parts:
        data = _fetch(url, param, limits, limits.max_bytes, "image")
        try:
            images.append(load_image(data, param, limits.max_pixels, limits.max_bytes))
        except ValueError as exc:
            raise APIError(str(exc), 400, param=param) from None
    return images


def load_videos(parts: list[tuple[str, str]], limits: MediaLimits, processor) -> list:
    """The parts' videos, decoded, sampled and checked by the model's processor (blocking: run it off the loop)."""
    if parts and not limits.takes_videos:
        raise APIError("this model takes no video input", 400, param=f"{parts[0][0]}.type")
    _check_count(parts, limits.max_videos, "videos")
    videos = []
    for param, url in parts:
        data = _fetch(url, param, limits, limits.max_video_bytes, "video")
        try:
            videos.append(processor.load_video(data, param, limits.max_pixels))
        except ValueError as exc:
            raise APIError(str(exc), 400, param=param) from None
    return videos


def _fetch(url: str, param: str, limits: MediaLimits, max_bytes: int, what: str) -> bytes:
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise APIError(f"{param}: a data URL must be base64 (data:{what}/...;base64,...)", 400, param=param)
        if len(payload) > max_bytes * 4 // 3 + 4:
            raise APIError(f"{param}: the {what} is over the limit of {max_bytes} bytes", 400, param=param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(f"{param}: the data URL is not valid base64", 400, param=param) from None
    if url.startswith(("http://", "https://")):
        if not limits.allow_remote:
            raise APIError(
                f"{param}: remote {what} URLs are off on this server (--no-remote-media); send a data URL",
                400,
                param=param,
            )
        try:
            with urllib.request.urlopen(url, timeout=limits.timeout) as response:  # noqa: S310 - http(s) only
                data = response.read(max_bytes + 1)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise APIError(f"{param}: could not fetch the {what} ({exc})", 400, param=param) from None
        if len(data) > max_bytes:
            raise APIError(f"{param}: the {what} is over the limit of {max_bytes} bytes", 400, param=param)
        return data
    raise APIError(f"{param}: {what}_url.url must be a data: or http(s) URL", 400, param=param)
