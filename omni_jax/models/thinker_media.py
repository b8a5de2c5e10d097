"""What both families' thinkers share in running their media encoders: the shape buckets, the
placeholder rows, and the encoder runner each family's media encoder builds on.

`ThinkerMediaEncoder.prepare(token_ids, mm)` turns a request's multimodal data into the
runner's `StageInputs`: the encoder features (audio, image, video, each in prompt order)
become overlay rows placed at their placeholder tokens (`media_index`), and the 3-row M-RoPE
positions come from the family's rope index. The encoders are jitted over their own shape
buckets (audio chunks, vision patches), padded on the host with numpy, so serving never
compiles after warm-up. A family's subclass runs its encoders (`_encode_audio_call`,
`_encode_vision_call`, `_encode`), computes its positions (`_rope_index`) and adds its own rows
(`_extra_inputs`: Qwen3's DeepStack features).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from ..engine import program_cache
from ..engine.buckets import pick_bucket
from ..engine.jitted import NO_TRITON_GEMM, Jitted
from ..engine.lru_cache import LRUCache
from ..engine.protocol import MultiModalPayload, StageInputs
from ..errors import TooLongError


@dataclasses.dataclass(frozen=True)
class MediaBuckets:
    """Shape buckets of the encoders."""

    audio_chunks: tuple[int, ...] = (1, 4, 16)
    vision_patches: tuple[int, ...] = (256, 1024, 4096)

    @classmethod
    def of(cls, stage) -> "MediaBuckets":
        """A thinker stage config's buckets."""
        return cls(stage.audio_chunk_buckets, stage.vision_patch_buckets)


# Host memory for the encoder rows of recent media items (`EncoderCache`): about 3 minutes of
# audio, or 90 images of 192 tokens, at the 7B thinker's width.
ENCODER_CACHE_BYTES = 256 << 20


class EncoderCache(LRUCache):
    """Encoder rows of recent media items by their inputs' key, least recently used first out,
    at most `max_bytes`: a conversation's turns encode each clip and image once."""

    def __init__(self, max_bytes: int = ENCODER_CACHE_BYTES):
        super().__init__(max_bytes)
        self.hits = self.misses = 0

    def missing(self, keys: list[str]) -> list[int]:
        """The positions of the keys not held (counted as misses, the rest as hits)."""
        out = [i for i, key in enumerate(keys) if key not in self]
        self.hits, self.misses = self.hits + len(keys) - len(out), self.misses + len(out)
        return out


def placeholder_ids(cfg) -> dict[str, int]:
    """The placeholder token of each media kind of a thinker config."""
    return {"audio": cfg.audio_token_id, "image": cfg.image_token_id, "video": cfg.video_token_id}


def media_index(token_ids: np.ndarray, cfg, media_order: Sequence[str]) -> np.ndarray:
    """Row of the concatenated encoder output for each placeholder token, -1 for text.

    `media_order` names the order in which encoder outputs are concatenated, e.g.
    ("audio", "image", "video"): each kind's placeholders take consecutive rows of its
    own block, in prompt order, the way transformers' masked_scatter fills them.
    """
    token_ids = np.asarray(token_ids)
    ids = placeholder_ids(cfg)
    index = np.full(token_ids.shape, -1, np.int32)
    offset = 0
    for kind in media_order:
        mask = token_ids == ids[kind]
        n = int(mask.sum())
        index[mask] = offset + np.arange(n, dtype=np.int32)
        offset += n
    return index


def _flat(module: nnx.Module):
    """(params -> the module, its parameters as a flat list)."""
    graphdef, state = nnx.split(module)
    params, tree = jax.tree.flatten(state)
    return (lambda p: nnx.merge(graphdef, jax.tree.unflatten(tree, p))), params


class ThinkerMediaEncoder:
    """Jitted, bucketed audio and vision encoders of a thinker (a family subclasses it)."""

    def __init__(self, thinker, cfg, rope_cfg, buckets: MediaBuckets = MediaBuckets()):
        self.cfg, self.rope_cfg, self.buckets = cfg, rope_cfg, buckets
        self.encoded = EncoderCache()
        # Each encoder's parameters as a flat list (a tree the program cache can key): a
        # restarted stage reads its encoder programs back instead of tracing them.
        audio, self.audio_params = _flat(thinker.audio_tower)
        vision, self.vision_params = _flat(thinker.visual)
        self.jitted = Jitted(audio=program_cache.jit("media.audio", lambda p, *a: audio(p)(*a),
                                                     compiler_options=NO_TRITON_GEMM),
                             vision=program_cache.jit("media.vision", lambda p, *a: vision(p)(*a),
                                                      compiler_options=NO_TRITON_GEMM))
        self.dtype = self.audio_params[0].dtype

    # ------------------------------------------------------------------ a family's part
    def _encode_audio_call(self, features: list[np.ndarray], request_lens: np.ndarray) -> np.ndarray:
        """Audio embeddings [tokens, hidden] of these audios (or pieces of them) in one encoder
        call of at most the largest chunk bucket; `request_lens`: the mel frames of every audio
        of the request, as one transformers call over them all sees them."""
        raise NotImplementedError

    def _audio_window_chunks(self) -> int:
        """Chunks of one attention window of the audio encoder: a long audio may be cut between
        windows and give the same rows (Qwen2.5's encoder attends within each chunk)."""
        return 1

    def _encode_vision_call(self, pixel_values: np.ndarray, grid_thw: np.ndarray
                            ) -> tuple[np.ndarray, np.ndarray | None]:
        """(features [merged tokens, hidden], the family's extra rows [K, tokens, hidden] or None) of
        these items (or runs of their frames) in one encoder call of at most the largest patch bucket."""
        raise NotImplementedError

    def _encode(self, kind: str, mm: MultiModalPayload, request_lens: np.ndarray):
        """(features, extra) of the items of one media kind in `mm` (some of a request's);
        `request_lens`: the mel frames of every audio of the request."""
        raise NotImplementedError

    def _num_chunks(self, lens: np.ndarray) -> int:
        """Encoder chunks the audios of these lengths (mel frames) need together."""
        raise NotImplementedError

    def _audio_tokens(self, lens: np.ndarray) -> np.ndarray:
        """Placeholder tokens (encoder rows) of each audio of these lengths (mel frames)."""
        raise NotImplementedError

    def _audio_tail(self, lens: np.ndarray) -> bytes:
        """What an audio's encoder rows depend on besides its own features, for a request whose
        audios have these lengths (a prefix-cache key part; Qwen2.5's encoder: nothing)."""
        return b""

    def _rope_index(self, ids: np.ndarray, mm: MultiModalPayload, audio_lens) -> tuple[np.ndarray, int]:
        """The prompt's M-RoPE positions [3, T] and the delta of the positions after it."""
        raise NotImplementedError

    def _extra_inputs(self, media: list) -> dict:
        """`StageInputs` fields a family adds from `(kind, features, extra)` per media kind."""
        return {}

    # ------------------------------------------------------------------ host-side planning
    def encode_audio(self, features: Sequence[np.ndarray], request_lens: np.ndarray | None = None) -> np.ndarray:
        """Audio embeddings [tokens, hidden] of these audios, in order; `request_lens`: the mel
        frames of every audio of their request (default: these are all). Audio of more encoder
        chunks than the largest bucket takes several calls (`_audio_calls`): a prompt's audio is
        bounded by the thinker's context, not by a bucket."""
        features = [np.asarray(f) for f in features]
        lens = self._audio_lens(features) if request_lens is None else request_lens
        return np.concatenate([self._encode_audio_call(call, lens) for call in self._audio_calls(features)])

    def _audio_lens(self, features: Sequence[np.ndarray]) -> np.ndarray:
        """The mel frames of each audio, its features checked to be [num_mel_bins, frames]."""
        bins = self.cfg.audio.num_mel_bins
        for i, f in enumerate(features):
            shape = np.shape(f)
            if len(shape) != 2 or shape[0] != bins or shape[1] < 1:
                raise ValueError(f"audio {i}: expected log-mel features [{bins}, frames], got shape {shape}")
        return np.array([np.shape(f)[1] for f in features], np.int64)

    def _audio_calls(self, features: list[np.ndarray]) -> list[list[np.ndarray]]:
        """The audios of one request as encoder calls of at most the largest chunk bucket: one call
        when they fit; else each audio cut into pieces of whole attention windows (the encoders
        attend within those, so the rows are the same as one call's), packed in order."""
        largest, window = self.buckets.audio_chunks[-1], self._audio_window_chunks()
        need = self._num_chunks(np.array([f.shape[1] for f in features]))
        if need <= largest:
            return [features]
        cut = largest // window * window * self.cfg.audio.chunk_frames  # the frames of a piece, at most
        if cut == 0:
            raise TooLongError(f"audio too long: {need} encoder chunks, more than the largest bucket {largest}, "
                               f"which is less than one attention window ({window} chunks) to cut the audio at")
        calls, call, used = [], [], 0
        for f in features:
            for start in range(0, f.shape[1], cut):
                piece = f[:, start:start + cut]
                n = self._num_chunks(np.array([piece.shape[1]]))
                if call and used + n > largest:
                    calls.append(call)
                    call, used = [], 0
                call.append(piece)
                used += n
        return calls + [call]

    def _audio_input(self, features: list[np.ndarray]) -> tuple[np.ndarray, int, np.ndarray]:
        """Audio lengths of one encoder call, their chunk bucket, and the features padded to it [mel, chunks*W]."""
        acfg = self.cfg.audio
        lens = np.array([f.shape[1] for f in features], np.int64)
        chunks = pick_bucket(self._num_chunks(lens), self.buckets.audio_chunks)
        feats = np.zeros((acfg.num_mel_bins, chunks * acfg.chunk_frames), self.dtype)
        feats[:, :lens.sum()] = np.concatenate([np.asarray(f, np.float32) for f in features], axis=1)
        return lens, chunks, feats

    def encode_vision(self, pixel_values: np.ndarray, grid_thw: np.ndarray, what: str
                      ) -> tuple[np.ndarray, np.ndarray | None]:
        """(features, the family's extra rows or None) of all items of `grid_thw` (images, or
        videos), in order. Items of more patches than the largest bucket take several calls
        (`_vision_calls`): a prompt's images and video are bounded by the context, not by a bucket."""
        vcfg = self.cfg.vision
        pixel_values = np.asarray(pixel_values)
        grid_thw = np.asarray(grid_thw, np.int64).reshape(-1, 3)
        n = int(np.prod(grid_thw, axis=1).sum())
        if pixel_values.ndim != 2 or pixel_values.shape != (n, vcfg.patch_dim):
            raise ValueError(f"{what}: pixel values of shape {pixel_values.shape} do not match grids "
                             f"{grid_thw.tolist()} (expected ({n}, {vcfg.patch_dim}))")
        outs = [self._encode_vision_call(pixel_values[rows], grid) for rows, grid in self._vision_calls(grid_thw, what)]
        extra = None if outs[0][1] is None else np.concatenate([e for _, e in outs], axis=1)
        return np.concatenate([f for f, _ in outs]), extra

    def _vision_calls(self, grid_thw: np.ndarray, what: str) -> list[tuple[np.ndarray | slice, np.ndarray]]:
        """(pixel rows, grids) of each encoder call over these items: one call when they fit the
        largest bucket; else runs of whole frames (t of a [t, h, w] grid; the patches are frame-major),
        packed in order. Both encoders attend within each frame (item, t) and embed positions by
        (h, w) alone, so the rows are the same as one call's."""
        largest = self.buckets.vision_patches[-1]
        if int(np.prod(grid_thw, axis=1).sum()) <= largest:
            return [(slice(None), grid_thw)]
        calls, rows, grids, used, start = [], [], [], 0, 0
        for t, h, w in grid_thw.tolist():
            frame = h * w
            if frame > largest:
                one = "frame" if what == "video" else "image"
                raise TooLongError(f"{what} too large: {frame} patches in one {one}, more than the largest "
                                   f"bucket {largest}")
            left = t
            while left:
                take = min(left, (largest - used) // frame)
                if take == 0:  # this call is full
                    calls.append((np.concatenate(rows), np.array(grids)))
                    rows, grids, used = [], [], 0
                    continue
                rows.append(np.arange(start, start + take * frame))
                grids.append((take, h, w))
                used, start, left = used + take * frame, start + take * frame, left - take
        return calls + [(np.concatenate(rows), np.array(grids))]

    def _vision_input(self, pixel_values: np.ndarray) -> tuple[int, np.ndarray]:
        """The patch bucket of one encoder call and its patches padded to it."""
        patches = pick_bucket(len(pixel_values), self.buckets.vision_patches)
        padded = np.zeros((patches, self.cfg.vision.patch_dim), self.dtype)
        padded[:len(pixel_values)] = pixel_values
        return patches, padded

    def _items(self, mm: MultiModalPayload, lens: np.ndarray) -> dict[str, tuple[np.ndarray, list[str]]]:
        """Per media kind present: each item's placeholder tokens (encoder rows) and key, in order."""
        out = {}
        for kind, keys in mm.item_hashes(self._audio_tail(lens) if len(lens) else b"").items():
            if kind == "audio":
                rows = np.asarray(self._audio_tokens(lens), np.int64)
            else:
                grids = mm.image_grid_thw if kind == "image" else mm.video_grid_thw
                rows = np.prod(np.asarray(grids, np.int64).reshape(-1, 3), axis=1) // self.cfg.vision.merge_unit
            out[kind] = (rows, keys)
        return out

    def _encode_items(self, kind: str, mm: MultiModalPayload, lens: np.ndarray, rows: np.ndarray,
                      keys: list[str]) -> tuple[np.ndarray, np.ndarray | None]:
        """(features, extra) of one kind's items in order: what the encoder cache holds is read
        back, the rest is encoded together (and kept)."""
        missing = self.encoded.missing(keys)
        fresh = {}
        if missing:
            feats, extra = self._encode(kind, mm.select(kind, missing), lens)
            want = rows[missing]
            if len(feats) != want.sum():
                raise ValueError(f"the {kind} inputs give {len(feats)} features for {int(want.sum())} placeholder tokens")
            for i, n, end in zip(missing, want, np.cumsum(want)):
                fresh[keys[i]] = (feats[end - n:end], None if extra is None else extra[:, end - n:end])
        parts = [fresh[key] if key in fresh else self.encoded.get(key) for key in keys]
        for key, part in fresh.items():
            self.encoded.put(key, part)
        feats = np.concatenate([f for f, _ in parts])
        return feats, None if parts[0][1] is None else np.concatenate([e for _, e in parts], axis=1)

    def _encode_media(self, ids: np.ndarray, mm: MultiModalPayload, lens: np.ndarray,
                      items: dict) -> list[tuple[str, np.ndarray, object]]:
        """(kind, features, extra) per media kind present, in (audio, image, video) order,
        each checked against the prompt's placeholder count. `extra` is what the family's
        `_encode` returns beside the features (Qwen3: DeepStack features)."""
        out = []
        for kind, tok in placeholder_ids(self.cfg).items():
            feats, extra = self._encode_items(kind, mm, lens, *items[kind]) if kind in items else (None, None)
            placeholders = int((ids == tok).sum())
            have = 0 if feats is None else len(feats)
            if placeholders != have:
                raise ValueError(f"the prompt has {placeholders} {kind} placeholder tokens but the {kind} "
                                 f"inputs give {have} features")
            if feats is not None:
                out.append((kind, feats, extra))
        return out

    @staticmethod
    def _media_ranges(ids: np.ndarray, cfg, items: dict) -> list:
        """Prefix-cache ranges: one per media item over its placeholders (a video and its audio
        track interleaved: one over both), keyed by the item's inputs. A conversation's turns keep
        the cached blocks of the media before them when a turn adds more."""
        tokens = placeholder_ids(cfg)
        spans = []  # [first, last, keys] of each item
        for kind, (rows, keys) in items.items():
            where = np.flatnonzero(ids == tokens[kind])  # as many as the rows (_encode_media checked)
            spans += [[int(where[end - n]), int(where[end - 1]), [key]]
                      for n, end, key in zip(rows, np.cumsum(rows), keys) if n]
        merged = []
        for span in sorted(spans):
            if merged and span[0] <= merged[-1][1]:  # interleaved with the one before
                merged[-1][1] = max(merged[-1][1], span[1])
                merged[-1][2] += span[2]
            else:
                merged.append(span)
        return [(first, last - first + 1, "+".join(keys)) for first, last, keys in merged]

    # ------------------------------------------------------------------ requests
    def prepare(self, token_ids: np.ndarray, mm: MultiModalPayload) -> tuple[StageInputs, list]:
        """StageInputs (overlay rows, M-RoPE positions, the family's extra rows) and prefix-cache media ranges."""
        ids = np.asarray(token_ids)
        lens = self._audio_lens(mm.audio_features)
        items = self._items(mm, lens)
        media = self._encode_media(ids, mm, lens, items)
        if not media:
            return StageInputs(), []
        positions, delta = self._rope_index(ids, mm, lens if len(lens) else None)
        index = media_index(ids, self.cfg, [kind for kind, _, _ in media])
        return StageInputs(mrope_positions=positions, mrope_delta=int(delta),
                           overlay_rows=np.concatenate([f for _, f, _ in media]).astype(np.float32),
                           overlay_index=index, **self._extra_inputs(media)), self._media_ranges(ids, self.cfg, items)

    def warmup(self) -> None:
        """Compile every encoder bucket."""
        acfg, vcfg = self.cfg.audio, self.cfg.vision
        for c in self.buckets.audio_chunks:
            self.encode_audio([np.zeros((acfg.num_mel_bins, c * acfg.chunk_frames), np.float32)])
        m = vcfg.spatial_merge_size
        for p in self.buckets.vision_patches:
            # A one-image grid of exactly p patches whose sides are multiples of the merge size.
            side = max(m, int(np.sqrt(p // (m * m))) * m)
            grid = np.array([[1, side, p // side]]) if p % side == 0 and (p // side) % m == 0 \
                else np.array([[1, m, p // m]])
            self.encode_vision(np.zeros((int(np.prod(grid)), vcfg.patch_dim), np.float32), grid, "image")
