"""Load the media of a prompt into plain arrays: RGB images, 16 kHz mono audio, sampled video frames.

Sources accepted (what a caller of a chat API hands over):
* images: a local path (or `file://` URL), a `data:` URL, raw bytes, a PIL image, or a numpy
  array [H, W], [H, W, 1|3|4] (uint8, or float in [0, 1]);
* audio: a path, `data:` URL or bytes of any format FFmpeg reads (PyAV), or `(array, sample_rate)`
  / `{"array", "sampling_rate"}` with a [n] or [n, channels] / [channels, n] array; downmixed to
  mono (channel mean, as librosa) and resampled to 16 kHz with soxr (librosa's default resampler);
* video: a path / `data:` URL / bytes decoded with PyAV and sampled at a target fps (the rule of
  transformers' Qwen2-VL video processor), or a list / array of frames already sampled at `fps`.
  Its audio track is decoded too when asked (for Qwen's `use_audio_in_video`).

Every problem raises `MediaError` naming the file and the numbers; the input processor adds
where in the prompt the item sits. Sizes are checked before any decoding work (`MediaLimits`):
pixel counts from the image header, sample rates, frame rates and frame counts from the stream
headers, so a hostile item costs its caller milliseconds, not gigabytes. A container can lie or
say nothing (a FLAC with no length), so decoding checks again as it goes: audio stops once its
samples pass the duration or sample limit, video once its frames pass the frame limit or a frame
is larger than the pixel limit; each decoded frame is also a point where a cancelled prompt stops.

Where a source string points is decided by one parser, `parse_source`, which the server's media
policy uses too, so the policy judges exactly what the reader opens.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import json
import math
import os
import re
from typing import Any

import numpy as np

from ..errors import MediaError
from . import cancel

__all__ = [
    "MediaError",
    "MediaLimits",
    "MediaSource",
    "parse_source",
    "source_key",
    "VideoClip",
    "load_image",
    "load_audio",
    "load_video",
    "resample",
    "sample_frame_indices",
]

TARGET_SAMPLE_RATE = 16000


@dataclasses.dataclass(frozen=True)
class MediaLimits:
    """What a media item may be, checked from its header before it is decoded.

    The defaults admit any real recording: telephone to studio sample rates (studio audio goes
    to 384 kHz), images up to 8192 x 8192 (a larger one is resized down to the model's
    max_pixels anyway, after costing its decode), high-speed video up to 1000 fps, and 300 s
    at 120 fps of frames to walk through.
    """

    min_sample_rate: float = 1000.0
    max_sample_rate: float = 384_000.0
    max_image_pixels: int = 8192 * 8192
    max_video_fps: float = 1000.0
    max_video_frames: int = 36_000
    # Decoded samples of one audio item at its own rate (mono float32: 4 bytes each, 64 MiB):
    # 349 s at 48 kHz, 44 s at 384 kHz.
    max_audio_samples: int = 1 << 24

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            whole = f.type == "int"  # the annotations are strings here
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (whole and not isinstance(value, int)) \
                    or not 0 < value < math.inf:
                raise ValueError(f"MediaLimits.{f.name} must be a positive {'int' if whole else 'finite number'}, "
                                 f"got {value!r}")
        if self.min_sample_rate > self.max_sample_rate:
            raise ValueError(f"MediaLimits.min_sample_rate {self.min_sample_rate:g} is above max_sample_rate "
                             f"{self.max_sample_rate:g}")

    @classmethod
    def from_json(cls, text: str) -> "MediaLimits":
        """Limits from a JSON object of field values (the server's --media-limits); ValueError if bad."""
        try:
            given = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"media limits are not valid JSON: {e}") from None
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(given, dict) or set(given) - set(names):
            raise ValueError(f"media limits must be a JSON object with keys among {names}, got {text!r}")
        return cls(**given)

    def check_sample_rate(self, rate: float, what: str) -> float:
        """`rate` as a float in [min_sample_rate, max_sample_rate], else MediaError: an absurd rate
        (inf, 1e30, 1e-30) would make the resampler run for ever or fill memory."""
        if not self.min_sample_rate <= rate <= self.max_sample_rate:
            raise MediaError(f"{what}: sample rate must be in [{self.min_sample_rate:g}, {self.max_sample_rate:g}] "
                             f"Hz, got {rate:g}")
        return float(rate)

    def check_pixels(self, width: int, height: int, what: str) -> None:
        """MediaError for an empty image or one with more pixels than max_image_pixels."""
        if width < 1 or height < 1:
            raise MediaError(f"{what} has no pixels ({width}x{height})")
        if width * height > self.max_image_pixels:
            raise MediaError(f"{what} is {width}x{height} = {width * height} pixels, more than the limit of "
                             f"{self.max_image_pixels}")

    def check_fps(self, fps: float, what: str) -> float:
        """`fps` as a float in (0, max_video_fps], else MediaError (fps=inf would make a zero duration)."""
        if not 0 < fps <= self.max_video_fps:
            raise MediaError(f"{what}: fps must be in (0, {self.max_video_fps:g}], got {fps:g}")
        return float(fps)

    def check_samples(self, n: int, what: str) -> None:
        """MediaError for more decoded samples than max_audio_samples."""
        if n > self.max_audio_samples:
            raise MediaError(f"{what} has more than {self.max_audio_samples} samples (max_audio_samples); "
                             f"decoding stopped there")

    def check_frames(self, total: int, what: str) -> None:
        """MediaError for more frames than max_video_frames (each would be decoded or loaded)."""
        if total > self.max_video_frames:
            raise MediaError(f"{what} has {total} frames, more than the limit of {self.max_video_frames}")


DEFAULT_LIMITS = MediaLimits()


@dataclasses.dataclass
class VideoClip:
    """Frames sampled from a video and, when asked for, its audio track.

    frames: [T, H, W, 3] uint8 RGB. fps: frames per second of the *sampled* frames (what the
    temporal position ids are derived from). audio: 16 kHz mono float32 track, or None when
    not asked for or the video is silent. duration: seconds covered by the video.
    """

    frames: np.ndarray
    fps: float
    duration: float
    audio: np.ndarray | None = None


# ---------------------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------------------

def _describe(src: Any) -> str:
    if isinstance(src, (str, os.PathLike)):
        s = os.fspath(src)
        return repr(s if len(s) <= 80 else s[:60] + "...")
    return type(src).__name__


@dataclasses.dataclass(frozen=True)
class MediaSource:
    """Where a media string points: kind "data" (a data: URL, `value` the whole URL), "path" (a
    local file, `value` the path; file:// URLs unquoted) or "remote" (any other URL scheme)."""

    kind: str
    value: str
    scheme: str = ""


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


def parse_source(src: str, what: str = "media") -> MediaSource:
    """The one reading of a media string, for the server's policy and for the loader alike.

    Schemes are matched case-insensitively (`DATA:` is a data: URL, as RFC 3986 says), so no
    spelling of a URL is read as a path by one and as a URL by the other. A path the OS cannot
    represent (a NUL byte, a lone surrogate) is a MediaError here, not an OS error later."""
    m = _SCHEME.match(src)
    scheme = m.group(1).lower() if m else ""
    if scheme == "data":
        return MediaSource("data", src, scheme)
    if scheme == "file":
        from urllib.parse import unquote, urlparse

        path = unquote(urlparse(src).path, errors="surrogateescape")
    elif scheme and (src[m.end():].startswith("//") or len(scheme) > 1):
        # Any other URL (http, https, ftp, s3...), and "name:rest" too: a local name that looks
        # like a scheme is not worth the doubt (Windows drive letters are one character).
        return MediaSource("remote", src, scheme)
    else:
        path = src
    if "\x00" in path:
        raise MediaError(f"{what} path holds a NUL character")
    try:
        os.fsencode(path)
    except UnicodeError:
        raise MediaError(f"{what} path is not one this system can represent (a lone surrogate?)") from None
    return MediaSource("path", path, scheme)


def _as_pair(src: Any) -> Any:
    """{"array", "sampling_rate"} (a datasets audio row) as the (waveform, sample_rate) pair it is."""
    if isinstance(src, dict) and "array" in src:
        return src["array"], src.get("sampling_rate", src.get("sample_rate"))
    return src


def source_key(src: Any) -> str | None:
    """A digest of a source that carries its content: a data: URL, bytes, a numpy array, a
    (waveform, sample_rate) pair or {"array", "sampling_rate"}. None for one that names its content
    (a path, a URL: the file may change under the name) and for other objects (a PIL image)."""
    h = hashlib.blake2b(digest_size=16)
    src = _as_pair(src)
    if isinstance(src, str):
        try:
            if parse_source(src).kind != "data":
                return None
        except MediaError:  # a path the loader refuses: nothing to keep
            return None
        h.update(b"url:" + src.encode("utf-8", "surrogatepass"))
    elif isinstance(src, (bytes, bytearray, memoryview)):
        h.update(b"bytes:")
        h.update(bytes(src))
    elif isinstance(src, np.ndarray) or (isinstance(src, tuple) and len(src) == 2 and isinstance(src[0], np.ndarray)):
        arr, rate = (src, None) if isinstance(src, np.ndarray) else src
        if arr.dtype.hasobject:
            return None
        arr = np.ascontiguousarray(arr)
        h.update(repr((arr.shape, arr.dtype.str, rate)).encode())
        h.update(arr.reshape(-1).view(np.uint8))
    else:
        return None
    return h.hexdigest()


def _read_source(src: Any, what: str) -> tuple[Any, str]:
    """A path or a binary buffer for a path / file:// / data: URL / bytes source, and how errors name it
    after its kind (the path, "bytes" or "data: URL")."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(src)), "bytes"
    if isinstance(src, os.PathLike):
        src = os.fspath(src)
    if not isinstance(src, str):
        raise MediaError(f"unsupported {what} source of type {type(src).__name__}")
    source = parse_source(src, what)
    if source.kind == "data":
        head, sep, payload = src.partition(",")
        if not sep:
            raise MediaError(f"malformed {what} data: URL (no ',' after the media type)")
        try:
            if head.lower().endswith(";base64"):
                data = base64.b64decode(payload, validate=False)
            else:
                from urllib.parse import unquote_to_bytes

                data = unquote_to_bytes(payload)
        except (binascii.Error, ValueError) as e:
            raise MediaError(f"{what} data: URL is not valid base64 ({e})") from None
        return io.BytesIO(data), "data: URL"
    if source.kind == "remote":
        raise MediaError(f"{what} {_describe(src)}: remote URLs are not fetched; pass a local path or a data: URL")
    path = source.value
    if not os.path.isfile(path):
        raise MediaError(f"{what} file {_describe(path)} does not exist or is not a file")
    return path, _describe(path)


def _b64_bytes(data: str, what: str) -> bytes:
    try:
        return base64.b64decode(data, validate=False)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"{what} is not valid base64 ({e})") from None


# ---------------------------------------------------------------------------------------
# images
# ---------------------------------------------------------------------------------------

def _array_to_pil(arr: np.ndarray, what: str, limits: MediaLimits):
    from PIL import Image

    a = np.asarray(arr)
    if a.ndim == 3 and a.shape[0] in (1, 3, 4) and a.shape[-1] not in (1, 3, 4):
        a = np.moveaxis(a, 0, -1)  # channels-first
    if a.ndim == 3 and a.shape[-1] == 1:
        a = a[..., 0]
    if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[-1] not in (3, 4)) or min(a.shape[:2]) < 1:
        raise MediaError(f"{what}: expected an array [H, W], [H, W, 1|3|4] or [C, H, W], got shape {a.shape}")
    limits.check_pixels(a.shape[1], a.shape[0], what)
    if a.dtype == np.uint8:
        pass
    elif a.dtype == np.bool_:
        a = a.astype(np.uint8) * 255
    elif np.issubdtype(a.dtype, np.floating):
        if not np.isfinite(a).all() or a.min() < 0.0 or a.max() > 1.0:
            raise MediaError(f"{what}: a float array must hold values in [0, 1]")
        a = np.round(a * 255.0).astype(np.uint8)
    else:
        raise MediaError(f"{what}: unsupported array dtype {a.dtype} (use uint8, or float in [0, 1])")
    img = Image.fromarray(np.ascontiguousarray(a))
    return img.convert("RGB")


def load_image(src: Any, what: str = "image", limits: MediaLimits = DEFAULT_LIMITS):
    """An RGB PIL image from a path / URL / bytes / PIL image / numpy array (EXIF rotation applied to files).

    The pixel count is checked against `limits` before decoding: a file's from its header."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if isinstance(src, Image.Image):
        limits.check_pixels(src.width, src.height, what)
        return src.convert("RGB")
    if isinstance(src, np.ndarray):
        return _array_to_pil(src, what, limits)
    handle, name = _read_source(src, what)
    try:
        with Image.open(handle) as img:
            # Image.open reads only the header: a small file can declare a huge canvas.
            limits.check_pixels(img.width, img.height, f"{what} {name}")
            img.load()
            img = ImageOps.exif_transpose(img)
            return img.convert("RGB")
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"cannot read {what} {name}: {_reason(e)}") from None


# ---------------------------------------------------------------------------------------
# audio
# ---------------------------------------------------------------------------------------

def _to_mono_float(arr: np.ndarray, what: str) -> np.ndarray:
    a = np.asarray(arr)
    if a.ndim not in (1, 2):
        raise MediaError(f"{what}: expected a waveform [n] or [n, channels], got shape {a.shape}")
    if np.issubdtype(a.dtype, np.integer):
        info = np.iinfo(a.dtype)
        if info.min == 0:  # unsigned PCM is offset by half the range
            a = (a.astype(np.float64) - (info.max + 1) / 2) / ((info.max + 1) / 2)
        else:
            a = a.astype(np.float64) / float(-info.min)
    elif not np.issubdtype(a.dtype, np.floating):
        raise MediaError(f"{what}: unsupported waveform dtype {a.dtype}")
    if a.ndim == 2:
        # Channels are the short axis: [n, C] (soundfile) or [C, n] (torchaudio / PyAV); mean as librosa.
        a = a.mean(axis=0 if a.shape[0] < a.shape[1] else 1, dtype=np.float64)
    a = a.astype(np.float32)
    if not np.isfinite(a).all():
        raise MediaError(f"{what}: the waveform has NaN or infinite samples")
    return a


def resample(wave: np.ndarray, rate: float, target: int = TARGET_SAMPLE_RATE) -> np.ndarray:
    """Resample a mono float32 waveform with soxr (high quality)."""
    if rate == target:
        return np.ascontiguousarray(wave, np.float32)
    import soxr

    return soxr.resample(np.ascontiguousarray(wave, np.float32), float(rate), float(target)).astype(np.float32)


def _check_seconds(n: int, rate: float, max_seconds: float | None, what: str) -> None:
    if max_seconds is not None and n / rate > max_seconds + 1e-6:
        raise MediaError(f"{what} lasts {n / rate:.2f} s, longer than the limit of {max_seconds:g} s")


def _decode_audio_stream(container, stream, name: str, what: str, max_seconds: float | None,
                         target_rate: int, limits: MediaLimits) -> np.ndarray:
    """Decode one PyAV audio stream to mono float32 at `target_rate`."""
    import av

    if stream.sample_rate:
        limits.check_sample_rate(stream.sample_rate, f"{what} {name}")

    meta = float(stream.duration * stream.time_base) if stream.duration else (
        container.duration / 1e6 if container.duration else None)
    if max_seconds is not None and meta is not None and meta > max_seconds + 0.5:
        raise MediaError(f"{what} {name} lasts {meta:.2f} s, longer than the limit of {max_seconds:g} s")
    # Planar float keeps every channel apart whatever the codec's sample format; rate and layout unchanged.
    converter = av.AudioResampler(format="fltp")
    chunks, rate, n = [], None, 0

    def take(out) -> None:
        nonlocal n
        # Downmixed frame by frame (the channel mean, as of the whole): memory holds one channel.
        chunks.append(out.to_ndarray().mean(axis=0, dtype=np.float64).astype(np.float32))
        n += chunks[-1].shape[0]
        # The header may say nothing or lie: the limits hold on what is decoded.
        if max_seconds is not None and n / rate > max_seconds + 1e-6:
            raise MediaError(f"{what} {name} lasts more than {max_seconds:g} s, the limit (decoding stopped at "
                             f"{n / rate:.2f} s)")
        limits.check_samples(n, f"{what} {name}")

    try:
        for frame in container.decode(stream):
            cancel.check()
            rate = rate or limits.check_sample_rate(frame.sample_rate, f"{what} {name}")
            for out in converter.resample(frame):
                take(out)
        if rate is not None:
            for out in converter.resample(None):
                take(out)
    except av.error.FFmpegError as e:
        raise MediaError(f"cannot decode {what} {name}: {_av_reason(e)}") from None
    if not chunks or rate is None:
        raise MediaError(f"{what} {name} has no audio samples")
    wave = np.concatenate(chunks)
    del chunks
    _check_seconds(wave.shape[0], rate, max_seconds, f"{what} {name}")
    return resample(wave, rate, target_rate)


def _av_reason(e) -> str:
    """An FFmpeg error without the file part (which for a buffer is an object's repr and address)."""
    return getattr(e, "strerror", None) or _reason(e)


def _reason(e: Exception) -> str:
    """A library's error text with object reprs (`<_io.BytesIO object at 0x...>`) said plainly:
    replies never carry heap addresses."""
    return _OBJECT_REPR.sub("the data", str(e))


_OBJECT_REPR = re.compile(r"<[^<>]*\bat 0x[0-9a-fA-F]+>")


def _open_av(src: Any, what: str):
    import av

    handle, name = _read_source(src, what)
    try:
        return av.open(handle, "r"), name
    except av.error.FFmpegError as e:
        raise MediaError(f"cannot read {what} {name}: {_av_reason(e)}") from None
    except (OSError, ValueError) as e:
        raise MediaError(f"cannot read {what} {name}: {type(e).__name__}") from None


def load_audio(src: Any, max_seconds: float | None = None, what: str = "audio",
               target_rate: int = TARGET_SAMPLE_RATE, limits: MediaLimits = DEFAULT_LIMITS) -> np.ndarray:
    """Mono float32 waveform at `target_rate` (16 kHz) of an audio source (see module docstring)."""
    src = _as_pair(src)
    if isinstance(src, tuple):
        if len(src) != 2 or src[1] is None:
            raise MediaError(f"{what}: give a (waveform, sample_rate) pair")
        arr, rate = src
        try:
            rate = float(rate)
        except (TypeError, ValueError):
            raise MediaError(f"{what}: sample rate {rate!r} is not a number") from None
        limits.check_sample_rate(rate, what)
        wave = _to_mono_float(arr, what)
        _check_seconds(wave.shape[0], rate, max_seconds, what)
        wave = resample(wave, rate, target_rate)
    elif isinstance(src, np.ndarray):
        raise MediaError(f"{what}: a bare array has no sample rate; pass (waveform, sample_rate)")
    else:
        container, name = _open_av(src, what)
        with container:
            if not container.streams.audio:
                raise MediaError(f"{what} {name} has no audio stream")
            wave = _decode_audio_stream(container, container.streams.audio[0], name, what, max_seconds,
                                        target_rate, limits)
    if wave.shape[0] == 0:
        raise MediaError(f"{what} is empty")
    return wave


# ---------------------------------------------------------------------------------------
# video
# ---------------------------------------------------------------------------------------

def sample_frame_indices(total: int, video_fps: float, fps: float, min_frames: int, max_frames: int,
                         temporal_patch_size: int = 2) -> np.ndarray:
    """Indices of the frames to keep: `fps` frames per second, clamped to [min_frames, max_frames].

    The rule of transformers' Qwen2-VL `sample_frames`: the count is rounded down to a
    multiple of the temporal patch size and the frames are spread uniformly (floor of
    k * total / n). A video too short for one temporal patch keeps all its frames.
    """
    tps = temporal_patch_size
    cap = math.floor(min(max_frames, total) / tps) * tps
    n = min(max(total / video_fps * fps, min_frames), cap, total)
    n = math.floor(n / tps) * tps
    if n < tps:
        return np.arange(total, dtype=np.int64)
    return (np.arange(n, dtype=np.int64) * total) // n


def _frames_array(frames: Any, what: str, limits: MediaLimits) -> np.ndarray:
    """[T, H, W, 3] uint8 from a list of images/arrays or a 4-D array (counts checked before loading)."""
    limits.check_frames(len(frames), what)
    if isinstance(frames, np.ndarray) and frames.ndim == 4 and frames.dtype == np.uint8 and frames.shape[-1] == 3:
        if frames.shape[0] == 0 or min(frames.shape[1:3]) < 1:
            raise MediaError(f"{what} has no frames (shape {frames.shape})")
        limits.check_pixels(frames.shape[2], frames.shape[1], f"{what} frame")
        return np.ascontiguousarray(frames)
    items = list(frames)
    if not items:
        raise MediaError(f"{what} has no frames")
    arrs = [np.asarray(load_image(f, f"{what} frame {i}", limits)) for i, f in enumerate(items)]
    shapes = {a.shape for a in arrs}
    if len(shapes) != 1:
        raise MediaError(f"{what}: all frames must have the same size, got {sorted(shapes)}")
    return np.stack(arrs)


def _decode_video(src: Any, what: str, fps: float, min_frames: int, max_frames: int, tps: int,
                  with_audio: bool, max_seconds: float | None, target_rate: int, limits: MediaLimits) -> VideoClip:
    import av

    container, name = _open_av(src, what)
    with container:
        if not container.streams.video:
            raise MediaError(f"{what} {name} has no video stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        if not rate:
            raise MediaError(f"{what} {name}: the frame rate is unknown")
        video_fps = limits.check_fps(float(rate), f"{what} {name}")
        ctx = stream.codec_context
        limits.check_pixels(ctx.width, ctx.height, f"{what} {name} frame")
        total = int(stream.frames or 0)
        if total <= 0:  # containers without a frame count: estimate from the duration
            if stream.duration:
                seconds = float(stream.duration * stream.time_base)
            elif container.duration:
                seconds = container.duration / 1e6
            else:
                seconds = 0.0
            total = int(round(seconds * video_fps))
        if total <= 0:
            raise MediaError(f"{what} {name}: cannot tell how many frames it has")
        limits.check_frames(total, f"{what} {name}")
        duration = total / video_fps
        if max_seconds is not None and duration > max_seconds + 1e-6:
            raise MediaError(f"{what} {name} lasts {duration:.2f} s, longer than the limit of {max_seconds:g} s")
        wanted = sample_frame_indices(total, video_fps, fps, min_frames, max_frames, tps)
        stream.thread_type = "AUTO"
        picked: list[np.ndarray] = []
        k = 0
        try:
            for i, frame in enumerate(container.decode(stream)):
                if k >= len(wanted):
                    break
                cancel.check()
                # The header's frame size and count may lie: each decoded frame is checked.
                limits.check_pixels(frame.width, frame.height, f"{what} {name} frame {i}")
                if i >= limits.max_video_frames:
                    limits.check_frames(i + 1, f"{what} {name}")
                if i == wanted[k]:
                    img = frame.to_ndarray(format="rgb24")
                    while k < len(wanted) and wanted[k] == i:
                        picked.append(img)
                        k += 1
        except av.error.FFmpegError as e:
            raise MediaError(f"cannot decode {what} {name}: {_av_reason(e)}") from None
        if not picked:
            raise MediaError(f"{what} {name} has no decodable frames")
        # The container's frame count can overstate what decodes; repeat the last frame for the rest.
        picked += [picked[-1]] * (len(wanted) - len(picked))
        has_audio = bool(container.streams.audio)
    audio = None
    if with_audio and has_audio:
        # A second pass over the file: the video pass stops early, after the last sampled frame.
        container, name = _open_av(src, what)
        with container:
            audio = _decode_audio_stream(container, container.streams.audio[0], name, f"{what} audio track",
                                         max_seconds, target_rate, limits)
    frames = np.stack(picked)
    return VideoClip(frames=frames, fps=len(wanted) / duration, duration=duration, audio=audio)


def load_video(src: Any, *, fps: float = 2.0, min_frames: int = 4, max_frames: int = 768,
               temporal_patch_size: int = 2, with_audio: bool = False, audio: Any = None,
               max_seconds: float | None = None, what: str = "video",
               target_rate: int = TARGET_SAMPLE_RATE, limits: MediaLimits = DEFAULT_LIMITS) -> VideoClip:
    """Sampled frames (and optionally the audio track) of a video; see the module docstring.

    For a file, `fps` is the sampling rate to aim for. For a list of frames, `fps` is the rate
    they were sampled at; more than `max_frames` frames are thinned out uniformly. `audio`
    gives the track of a frame list (any `load_audio` source); it is used when `with_audio`.
    Frame rate, frame size and frame count are checked against `limits` before decoding.
    """
    try:
        fps = float(fps)
    except (TypeError, ValueError):
        raise MediaError(f"{what}: fps {fps!r} is not a number") from None
    limits.check_fps(fps, what)
    is_frames = (isinstance(src, np.ndarray) and src.ndim == 4) or isinstance(src, (list, tuple))
    if not is_frames:
        if audio is not None:
            raise MediaError(f"{what}: 'audio' goes with a list of frames; a video file brings its own track")
        return _decode_video(src, what, fps, min_frames, max_frames, temporal_patch_size, with_audio, max_seconds,
                             target_rate, limits)
    frames = _frames_array(src, what, limits)
    total = frames.shape[0]
    duration = total / fps
    if max_seconds is not None and duration > max_seconds + 1e-6:
        raise MediaError(f"{what}: {total} frames at {fps:g} fps last {duration:.2f} s, longer than the limit "
                         f"of {max_seconds:g} s")
    if total > max_frames:
        keep = sample_frame_indices(total, fps, fps, 1, max_frames, temporal_patch_size)
        frames = frames[keep]
    track = None
    if with_audio and audio is not None:
        track = load_audio(audio, max_seconds=max_seconds, what=f"{what} audio track", target_rate=target_rate,
                           limits=limits)
    return VideoClip(frames=frames, fps=frames.shape[0] / duration, duration=duration, audio=track)
