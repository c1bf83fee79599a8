"""Images and videos in chat messages: each `image_url` / `video_url` content part (a data: URL, or an http(s) URL
fetched by media_fetch unless remote media is off) decoded once and checked; every failure a 400 naming the part.

A part given as a data URL is the client's own bytes: its errors say what is wrong with them. A part given as a
URL answers every failure alike (fetch_error), whether the host refused, answered 404, was an address the server
does not fetch from, or sent something that is no image: the answer must not turn the server into a probe of the
network behind it. The server log says which."""

from __future__ import annotations

import base64
import binascii
import logging
from dataclasses import dataclass

from petrel.multimodal.media import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, load_image
from petrel.multimodal.prompts import TEXT_ONLY
from petrel.multimodal.video import DEFAULT_MAX_VIDEO_BYTES
from petrel.serve.errors import APIError
from petrel.serve.limits import TRIM_AFTER_BYTES
from petrel.serve.media_fetch import FetchFailed, FetchItem

logger = logging.getLogger("petrel.serve")


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


def fetch_error(param: str, what: str) -> APIError:
    """The one answer to every failure of a media URL (the log has the reason)."""
    return APIError(
        f"{param}: could not load the {what} from its URL (the server fetches public http(s) hosts only, unless "
        "configured otherwise; send the bytes as a data URL)",
        400,
        param=param,
    )


async def load_media(state, messages, processor) -> tuple[list, list]:
    """(images, videos) of the request's image_url and video_url parts: checked for count and form, the URLs
    fetched (state.media_fetcher, its own pool), then decoded on the media pool."""
    limits = state.media
    images, videos = image_parts(messages), image_parts(messages, "video_url")
    if images and not limits.takes_images:
        raise APIError(TEXT_ONLY, 400, param=f"{images[0][0]}.type")
    if videos and not limits.takes_videos:
        raise APIError("this model takes no video input", 400, param=f"{videos[0][0]}.type")
    _check_count(images, limits.max_images, "images")
    _check_count(videos, limits.max_videos, "videos")
    items = [FetchItem(p, u, limits.max_bytes, "image") for p, u in _remote(images, limits, "image")]
    items += [FetchItem(p, u, limits.max_video_bytes, "video") for p, u in _remote(videos, limits, "video")]
    try:
        fetched = await state.media_fetcher.fetch_all(items)
    except FetchFailed as exc:
        logger.warning("media fetch refused or failed: %s", exc)
        raise fetch_error(exc.item.param, exc.item.what) from None
    except APIError as exc:
        if exc.status == 429:  # every fetch slot taken: refused for load, as a full server refuses
            state.llm.engine.events.rejected()
        raise
    images = await state.run_media(load_images, images, limits, fetched) if images else []
    videos = await state.run_media(load_videos, videos, limits, processor, fetched) if videos else []
    return images, videos


def holds_much_memory(images, videos) -> bool:
    """Whether the decoded pixels take enough memory that letting them go deserves a heap trim: glibc keeps what
    a decoded 6000x6000 image and its processing free (+300 MiB RSS for good without a trim)."""
    frames = [*images, *(f for v in videos for f in v.frames)]
    return sum(f.size[0] * f.size[1] * len(f.getbands()) for f in frames) >= TRIM_AFTER_BYTES


def _remote(parts: list[tuple[str, str]], limits: MediaLimits, what: str) -> list[tuple[str, str]]:
    """The parts to fetch (http(s) URLs); a 400 for a URL of another scheme, or any while remote media is off."""
    remote = []
    for param, url in parts:
        if url.startswith("data:"):
            continue
        if not url[:8].lower().startswith(("http://", "https://")):
            raise APIError(f"{param}: {what}_url.url must be a data: or http(s) URL", 400, param=param)
        if not limits.allow_remote:
            raise APIError(
                f"{param}: remote {what} URLs are off on this server (--no-remote-media); send a data URL",
                400,
                param=param,
            )
        remote.append((param, url))
    return remote


def _check_count(parts: list[tuple[str, str]], limit: int | None, what: str) -> None:
    """A 400 naming the first part over the per-prompt limit (--limit-mm-per-prompt)."""
    if limit is not None and len(parts) > limit:
        raise APIError(
            f"{len(parts)} {what} in this request, over the limit of {limit} per prompt (--limit-mm-per-prompt)",
            400,
            param=parts[limit][0],
        )


def load_images(parts: list[tuple[str, str]], limits: MediaLimits, fetched: dict[str, bytes] | None = None) -> list:
    """The parts' images, decoded and checked (blocking: run it off the event loop). fetched: the bytes of the
    parts given as URLs, by param."""
    images = []
    for param, url in parts:
        data = _bytes(param, url, limits.max_bytes, "image", fetched)
        try:
            images.append(load_image(data, param, limits.max_pixels, limits.max_bytes))
        except ValueError as exc:
            raise _decode_error(exc, param, "image", fetched) from None
    return images


def load_videos(parts: list[tuple[str, str]], limits: MediaLimits, processor, fetched: dict | None = None) -> list:
    """The parts' videos, decoded, sampled and checked by the model's processor (blocking: run it off the loop)."""
    videos = []
    for param, url in parts:
        data = _bytes(param, url, limits.max_video_bytes, "video", fetched)
        try:
            videos.append(processor.load_video(data, param, limits.max_pixels))
        except ValueError as exc:
            raise _decode_error(exc, param, "video", fetched) from None
    return videos


def _decode_error(exc: ValueError, param: str, what: str, fetched: dict | None) -> APIError:
    if fetched and param in fetched:  # fetched bytes that are no (acceptable) image: answered as any fetch failure
        logger.warning("media fetch refused or failed: %s: %s", param, exc)
        return fetch_error(param, what)
    return APIError(str(exc), 400, param=param)


def _bytes(param: str, url: str, max_bytes: int, what: str, fetched: dict | None) -> bytes:
    if fetched and param in fetched:
        return fetched[param]
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise APIError(f"{param}: a data URL must be base64 (data:{what}/...;base64,...)", 400, param=param)
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise APIError(f"{param}: the {what} is over the limit of {max_bytes} bytes", 400, param=param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(f"{param}: the data URL is not valid base64", 400, param=param) from None
