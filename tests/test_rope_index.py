"""Qwen2.5-Omni's M-RoPE position ids (models/qwen2_5_omni/rope_index.py over inputs/rope_index.py) against
transformers' get_rope_index."""

from __future__ import annotations

import json
import os
import types

import numpy as np
import pytest
import torch

import hf_tiny
from omni_jax.inputs.rope_index import RopeIndexConfig, decode_positions
from omni_jax.models.qwen2_5_omni.audio_encoder import audio_output_lengths
from omni_jax.models.qwen2_5_omni.rope_index import get_rope_index

pytestmark = pytest.mark.parity

CFG = RopeIndexConfig(
    image_token_id=hf_tiny.IMAGE_TOKEN, video_token_id=hf_tiny.VIDEO_TOKEN, audio_token_id=hf_tiny.AUDIO_TOKEN,
    vision_start_token_id=hf_tiny.VISION_START, vision_end_token_id=hf_tiny.VISION_END,
    audio_start_token_id=hf_tiny.AUDIO_START, audio_end_token_id=hf_tiny.AUDIO_END,
    spatial_merge_size=2, position_id_per_seconds=25, seconds_per_chunk=2,
)
MERGE = 2


@pytest.fixture(scope="module")
def hf_thinker(qwen2_5_omni_hf_model):
    """The module that owns get_rope_index / compute_3d_position_ids (Qwen2_5OmniThinkerModel)."""
    return qwen2_5_omni_hf_model.thinker.model


# ---------------------------------------------------------------- prompt building
class Prompt:
    """Token ids plus the media metadata a processor would return alongside them."""

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.ids: list[int] = []
        self.images: list[tuple] = []
        self.videos: list[tuple] = []
        self.spg: list[float] = []
        self.mels: list[int] = []  # in prompt order, audio inside videos included

    def text(self, n: int) -> "Prompt":
        self.ids += self.rng.integers(0, 151000, n).tolist()  # below every special token
        return self

    def image(self, grid) -> "Prompt":
        self.images.append(tuple(grid))
        n = int(np.prod(grid)) // MERGE**2
        self.ids += [hf_tiny.VISION_START] + [hf_tiny.IMAGE_TOKEN] * n + [hf_tiny.VISION_END]
        return self

    def video(self, grid, spg: float = 1.0) -> "Prompt":
        self.videos.append(tuple(grid))
        self.spg.append(spg)
        n = int(np.prod(grid)) // MERGE**2
        self.ids += [hf_tiny.VISION_START] + [hf_tiny.VIDEO_TOKEN] * n + [hf_tiny.VISION_END]
        return self

    def audio(self, mel: int) -> "Prompt":
        self.mels.append(mel)
        n = int(audio_output_lengths(mel)[1])
        self.ids += [hf_tiny.AUDIO_START] + [hf_tiny.AUDIO_TOKEN] * n + [hf_tiny.AUDIO_END]
        return self

    def video_with_audio(self, grid, spg: float, mel: int) -> "Prompt":
        """<vision_bos> + the processor's own expansion of <|VIDEO|> + <vision_eos>."""
        self.videos.append(tuple(grid))
        self.spg.append(spg)
        self.mels.append(mel)
        self.ids += [hf_tiny.VISION_START] + _processor_av_tokens(grid, spg, mel) + [hf_tiny.VISION_END]
        return self

    def hf_kwargs(self) -> dict:
        return dict(
            image_grid_thw=torch.tensor(self.images) if self.images else None,
            video_grid_thw=torch.tensor(self.videos) if self.videos else None,
            audio_seqlens=torch.tensor(self.mels) if self.mels else None,
            second_per_grids=torch.tensor(self.spg) if self.videos else None,
        )

    def ours_kwargs(self) -> dict:
        return dict(
            image_grid_thw=np.array(self.images) if self.images else None,
            video_grid_thw=np.array(self.videos) if self.videos else None,
            audio_seqlens=np.array(self.mels) if self.mels else None,
            second_per_grids=np.array(self.spg) if self.videos else None,
        )


def _processor_av_tokens(grid, spg: float, mel: int) -> list[int]:
    """Token layout of a video with its audio, from Qwen2_5OmniProcessor.replace_video_with_audio_token.

    The processor itself needs torchvision; its method only reads a few attributes, so
    it runs on a stand-in `self` with one-character tokens that map back to ids.
    """
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor as P

    stand_in = types.SimpleNamespace(
        video_processor=types.SimpleNamespace(merge_size=MERGE),
        audio_bos_token="<", audio_eos_token=">", video_token="V", audio_token="A",
        get_chunked_index=lambda idx, k: P.get_chunked_index(None, idx, k),
    )
    text = P.replace_video_with_audio_token(
        stand_in,
        {"video_grid_thw": [np.array(grid)], "video_second_per_grid": [spg]}, 0,
        {"num_audio_tokens": [int(audio_output_lengths(mel)[1])]}, 0,
        position_id_per_seconds=25, seconds_per_chunk=2.0,
    )
    table = {"<": hf_tiny.AUDIO_START, ">": hf_tiny.AUDIO_END, "V": hf_tiny.VIDEO_TOKEN, "A": hf_tiny.AUDIO_TOKEN}
    return [table[ch] for ch in text]


def _check(hf_thinker, prompt: Prompt, use_audio_in_video: bool = False) -> np.ndarray:
    ids = np.array(prompt.ids)
    ref_pos, ref_delta = hf_thinker.get_rope_index(
        torch.tensor(ids)[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        use_audio_in_video=use_audio_in_video, **prompt.hf_kwargs(),
    )
    pos, delta = get_rope_index(ids, CFG, use_audio_in_video=use_audio_in_video, **prompt.ours_kwargs())
    assert pos.dtype == np.int32 and pos.shape == (3, len(ids))
    np.testing.assert_array_equal(pos, ref_pos[:, 0].numpy())
    assert delta == int(ref_delta.reshape(-1)[0])
    return pos


# ---------------------------------------------------------------- cases
def test_text_only(hf_thinker):
    p = Prompt().text(17)
    pos = _check(hf_thinker, p)
    np.testing.assert_array_equal(pos, np.tile(np.arange(17), (3, 1)))


def test_one_image(hf_thinker):
    pos = _check(hf_thinker, Prompt().text(5).image((1, 6, 8)).text(7))
    # 3x4 merged grid from id 6: h ids 6..8, w ids 6..9; text resumes after the max (9) + eos.
    np.testing.assert_array_equal(pos[:, 6:10], [[6] * 4, [6] * 4, [6, 7, 8, 9]])
    assert pos[0, 18] == 10 and pos[0, 19] == 11


def test_two_images(hf_thinker):
    _check(hf_thinker, Prompt().text(3).image((1, 4, 4)).text(2).image((1, 8, 6)).text(4))
    _check(hf_thinker, Prompt().image((2, 4, 4)).image((1, 12, 4)))  # back to back, t=2 grid


@pytest.mark.parametrize("spg", [1.0, 2.0, 0.5, 0.7, 4 / 3])
def test_video(hf_thinker, spg):
    _check(hf_thinker, Prompt().text(6).video((8, 6, 4), spg).text(9))


def test_audio_only(hf_thinker):
    # Two audios of different lengths: HF leaves audio-only prompts 1-D (arange).
    p = Prompt().text(4).audio(400).text(3).audio(157).text(2)
    pos = _check(hf_thinker, p)
    np.testing.assert_array_equal(pos, np.tile(np.arange(len(p.ids)), (3, 1)))


def test_mixed_audio_image_video(hf_thinker):
    p = (Prompt(1).text(4).audio(333).text(2).image((1, 6, 6)).text(3)
         .video((4, 4, 8), 1.0).text(1).image((1, 4, 10)).audio(1000).text(5))
    _check(hf_thinker, p)


@pytest.mark.parametrize("grid,spg,mel", [
    ((4, 4, 6), 1.0, 400),    # audio as long as the video
    ((6, 4, 4), 1.0, 150),    # fewer audio chunks than video chunks
    ((2, 40, 40), 1.0, 1000),  # more audio chunks; wide frames
    ((2, 40, 40), 1.0, 80),   # the last chunk (audio) is not the block max
    ((8, 4, 4), 2.5, 1200),   # frames more than one chunk apart
    ((3, 4, 4), 0.7, 640),    # non-integral temporal ids
])
def test_audio_in_video(hf_thinker, grid, spg, mel):
    p = Prompt().text(7).video_with_audio(grid, spg, mel).text(11)
    _check(hf_thinker, p, use_audio_in_video=True)


def test_audio_in_video_with_other_media(hf_thinker):
    p = (Prompt(2).text(3).audio(250).text(2).video_with_audio((4, 6, 4), 1.0, 410).text(2)
         .image((1, 4, 6)).video_with_audio((2, 4, 4), 2.0, 390).text(6))
    _check(hf_thinker, p, use_audio_in_video=True)


@pytest.mark.parametrize("seed", range(16))
def test_random_prompts(hf_thinker, seed):
    rng = np.random.default_rng(100 + seed)
    av = bool(seed % 2)
    p = Prompt(seed).text(int(rng.integers(0, 6)))
    kinds = ["image", "video", "audio"] + (["av"] if av else [])
    for _ in range(int(rng.integers(1, 5))):
        kind = kinds[rng.integers(len(kinds))]
        grid = (int(rng.integers(1, 7)), 2 * int(rng.integers(1, 7)), 2 * int(rng.integers(1, 7)))
        spg = float(rng.choice([0.5, 0.7, 1.0, 1.3, 2.0, 2.5]))
        mel = int(rng.integers(3, 1500))
        if kind == "image":
            p.image((1,) + grid[1:])
        elif kind == "video":
            if av:  # HF reads every video as audio-carrying when use_audio_in_video is set
                p.video_with_audio(grid, spg, mel)
            else:
                p.video(grid, spg)
        elif kind == "audio":
            p.audio(mel)
        else:
            p.video_with_audio(grid, spg, mel)
        p.text(int(rng.integers(0, 4)))
    _check(hf_thinker, p, use_audio_in_video=av)


# ---------------------------------------------------------------- helpers and decode
def test_audio_output_lengths(hf_thinker):
    mel = torch.arange(1, 3001)
    _, ref = hf_thinker.audio_tower._get_feat_extract_output_lengths(mel)
    np.testing.assert_array_equal(audio_output_lengths(mel.numpy())[1], ref.numpy())


def test_config_from_hf(hf_thinker, qwen2_5_omni_hf_dir):
    assert RopeIndexConfig.from_hf(hf_thinker.config) == CFG
    with open(os.path.join(qwen2_5_omni_hf_dir, "config.json")) as f:
        full = json.load(f)
    assert RopeIndexConfig.from_hf(full) == CFG
    assert RopeIndexConfig.from_hf(full["thinker_config"]) == CFG


class _FakeCache:
    """Just enough of a transformers Cache for compute_3d_position_ids."""

    def __init__(self, length: int):
        self.length = length

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.length


def test_decode_positions(hf_thinker):
    p = Prompt(3).text(4).image((1, 8, 8)).video((6, 4, 4), 2.0).text(3)
    _, delta = get_rope_index(np.array(p.ids), CFG, **p.ours_kwargs())
    assert delta > 0  # the video's temporal ids (50 per grid step) outrun its 24 tokens
    computed = np.array([len(p.ids), len(p.ids) + 5, 9, 0])
    deltas = np.array([delta, delta, 0, 3])
    ours = decode_positions(computed, deltas)
    assert ours.dtype == np.int32 and ours.shape == (3, 4)
    hidden = hf_thinker.config.text_config.hidden_size
    try:
        for b in range(len(computed)):
            hf_thinker.rope_deltas = torch.tensor([[int(deltas[b])]])
            # The cache by position: transformers renamed it (past_key_values, now cache; the old
            # name goes in 5.40).
            ref = hf_thinker.compute_3d_position_ids(None, None, None, torch.zeros(1, 1, hidden), None,
                                                     _FakeCache(int(computed[b])))
            np.testing.assert_array_equal(ours[:, b], ref[:, 0, 0].numpy())
    finally:
        hf_thinker.rope_deltas = None
    np.testing.assert_array_equal(ours, np.tile(computed + deltas, (3, 1)))


def test_prompt_errors():
    p = Prompt().text(2).image((1, 4, 4)).text(2)
    ids = np.array(p.ids)
    with pytest.raises(ValueError, match="image_grid_thw"):
        get_rope_index(ids, CFG)
    with pytest.raises(ValueError, match="placeholder"):
        get_rope_index(ids, CFG, image_grid_thw=np.array([[1, 4, 8]]))
    with pytest.raises(ValueError, match="audio_seqlens"):
        get_rope_index(np.array(Prompt().audio(100).ids), CFG)
