"""Chat messages with media -> token ids + encoder inputs (omni_jax.inputs.processor / media), for
Qwen2.5-Omni (`Qwen2_5InputProcessor`) and Qwen3-Omni (`Qwen3InputProcessor`).

A test taking `family` runs for both; `FAMILIES` holds what differs (placeholders, patch size,
audio padding, the transformers reference, expected numbers). Checked for both: the chat template
with image / audio / video placeholders expanded, and the encoder inputs, equal transformers'
processor, and rope positions the tiny transformers thinker's (with and without
use_audio_in_video); the prompt forms (messages, prompt + multi_modal_data, token ids), media
sources and loading; the speech-output system prompt; from_checkpoint through the registry; bad
prompts raise PromptError naming the problem. Qwen3-Omni alone: a chat end to end against
transformers' generate.

The reference is each family's transformers processor (`Qwen2_5OmniProcessor`,
`Qwen3OmniMoeProcessor`) run in parts, as the whole class needs torchvision for its video
processor: its own `_process_audio` (WhisperFeatureExtractor with the processor's audio kwargs,
token counts), its placeholder replacement methods on a stand-in `self`, `Qwen2VLImageProcessorPil`
with the family's released preprocessor_config.json values, and video frames through that image
processor's steps laid out as Qwen2VLVideoProcessor does. The tokenizers are the product's
offline Qwen BPE with each family's added tokens.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import importlib
import json
import re
import types
import wave
from typing import Callable

import numpy as np
import pytest
import torch

import hf_tiny
import hf_tiny_qwen3
from omni_jax.engine.protocol import MultiModalPayload
from omni_jax.errors import PromptError, PromptTooLongError
from omni_jax.inputs.media import load_audio, load_video, sample_frame_indices
from omni_jax.inputs.qwen_tokenizer import (DEFAULT_SYSTEM_PROMPT, build_qwen2_5_omni_tokenizer,
                                            build_qwen3_omni_tokenizer)
from omni_jax.models.qwen2_5_omni.processor import Qwen2_5InputProcessor
from omni_jax.models.qwen2_5_omni.rope_index import get_rope_index
from omni_jax.models.qwen3_omni.processor import QWEN3_OMNI_CHAT_TEMPLATE, Qwen3InputProcessor
from omni_jax.models.qwen3_omni.rope_index import get_rope_index_qwen3
from omni_jax.models.registry import prompt_processor

pytestmark = pytest.mark.parity

VOCAB = 152064
MERGE = 2
# transformers processor attribute of each placeholder / bracket string -> its id in tests/hf_tiny*.py.
MARK_IDS = {"image_token": "IMAGE_TOKEN", "video_token": "VIDEO_TOKEN", "audio_token": "AUDIO_TOKEN",
            "vision_bos_token": "VISION_START", "vision_eos_token": "VISION_END",
            "audio_bos_token": "AUDIO_START", "audio_eos_token": "AUDIO_END"}


# ---------------------------------------------------------------------------------------- families
@dataclasses.dataclass(frozen=True)
class Family:
    """What differs between the two families' processors, their references and expected numbers."""

    name: str                       # the registry's family; conftest's fixtures are `<name>_hf_dir/_model`
    processor: type
    build_tokenizer: Callable
    ids: types.ModuleType           # the real special ids (tests/hf_tiny.py, tests/hf_tiny_qwen3.py)
    marks: dict                     # transformers processor attribute -> placeholder / bracket string
    extra_ids: dict                 # other added tokens the tokenizer must place (Qwen3's talker pad)
    hf_processor: str               # transformers' processor class (module path.Class)
    patch: int                      # vision patch size; images resize to multiples of 2 * patch
    image_norm: tuple               # image mean, std of the released preprocessor_config.json
    chat_template: str | None       # the reference's template (None: the tokenizer's own)
    system: str | None              # the template's default system message
    speech_system: str | None       # put first for speech output when the chat has no system message
    position_id_per_seconds: float
    hf_options: dict                # processor attributes read off the HF config
    rope_index: Callable            # ours: (ids, processor, **media) -> (positions, delta)
    # Expected numbers for this file's inputs.
    img_png_grid: list              # media_dir/img.png (45x70)
    tone_tokens: int                # the 1.5 s tone: 150 mel frames
    pair_frames: list               # the two clips of one prompt: mel frames ...
    pair_tokens: list               # ... and audio tokens
    lone_frames: int                # the shorter clip alone
    video_runs: int                 # runs of video tokens in clip.mkv's use_audio_in_video layout

    def triple(self, kind: str) -> str:
        """The placeholder a prompt writes for one media item."""
        bos, eos = ("audio_bos_token", "audio_eos_token") if kind == "audio" else ("vision_bos_token",
                                                                                 "vision_eos_token")
        return self.marks[bos] + self.marks[f"{kind}_token"] + self.marks[eos]

    @property
    def video_pixels(self) -> tuple[int, int]:
        """The processor's per-frame video pixel range: 128..768 merged patches."""
        side = MERGE * self.patch
        return 128 * side * side, 768 * side * side


FAMILIES = {f.name: f for f in (
    Family(
        name="qwen2_5_omni", processor=Qwen2_5InputProcessor, build_tokenizer=build_qwen2_5_omni_tokenizer,
        ids=hf_tiny,
        marks={"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
               "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
               "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"},
        extra_ids={},
        hf_processor="transformers.models.qwen2_5_omni.processing_qwen2_5_omni.Qwen2_5OmniProcessor",
        patch=14, image_norm=([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]),
        chat_template=None, system="You are a helpful assistant.", speech_system=DEFAULT_SYSTEM_PROMPT,
        position_id_per_seconds=25, hf_options={},
        rope_index=lambda ids, proc, **media: get_rope_index(ids, proc.tokens, **media),
        # 56x56; padded to 300 s, a clip keeps ceil(samples / hop) frames; 2 s chunks of 5 s.
        img_png_grid=[[1, 4, 4]], tone_tokens=37, pair_frames=[301, 57], pair_tokens=[75, 14], lone_frames=57,
        video_runs=3),
    Family(
        name="qwen3_omni", processor=Qwen3InputProcessor, build_tokenizer=build_qwen3_omni_tokenizer,
        ids=hf_tiny_qwen3,
        marks={"image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>", "video_token": "<|video_pad|>",
               "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
               "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"},
        extra_ids={"<tts_pad>": hf_tiny_qwen3.TTS_PAD},
        hf_processor="transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe.Qwen3OmniMoeProcessor",
        patch=16, image_norm=([0.5] * 3, [0.5] * 3),
        chat_template=QWEN3_OMNI_CHAT_TEMPLATE, system=None, speech_system=None,
        position_id_per_seconds=13, hf_options={"n_window": 50},
        rope_index=lambda ids, proc, **media: get_rope_index_qwen3(ids, proc.tokens, n_window=proc.n_window,
                                                                   **media),
        # 64x96; clips padded to the prompt's longest: floor(48077 / 160), ceil(9050 / 160), alone
        # floor(9050 / 160); 13 tokens per full 100-frame chunk; one video run per frame group.
        img_png_grid=[[1, 4, 6]], tone_tokens=20, pair_frames=[300, 57], pair_tokens=[39, 8], lone_frames=56,
        video_runs=5),
)}


# ---------------------------------------------------------------------------------------- fixtures
def _processor(family: Family):
    """The family's processor on the product's offline tokenizer, its marks where the tests expect."""
    tok = family.build_tokenizer()
    expected = {s: getattr(family.ids, MARK_IDS[attr]) for attr, s in family.marks.items()} | family.extra_ids
    assert {s: tok.convert_tokens_to_ids(s) for s in expected} == expected
    return family.processor(tok, VOCAB)


def _reference(family: Family):
    """transformers' processor in parts: the image processor with the released values, and a
    stand-in `self` for the processor's methods."""
    from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    module, name = family.hf_processor.rsplit(".", 1)
    P = getattr(importlib.import_module(module), name)
    mean, std = family.image_norm
    ip = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056, patch_size=family.patch,
                                  temporal_patch_size=2, merge_size=MERGE, image_mean=mean, image_std=std)
    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=300, n_fft=400,
                                 padding_value=0.0, dither=0.0, return_attention_mask=True)
    me = types.SimpleNamespace(
        feature_extractor=fe, n_window=getattr(P, "n_window", None),
        image_processor=types.SimpleNamespace(merge_size=MERGE),
        video_processor=types.SimpleNamespace(merge_size=MERGE, temporal_patch_size=2), **family.marks)
    for method in ("replace_audio_token", "get_chunked_index"):
        setattr(me, method, functools.partial(getattr(P, method), me))
    return types.SimpleNamespace(P=P, me=me, ip=ip)


# One per family for the module: tokenizers and transformers parts are slow to build.
@pytest.fixture(scope="module")
def qwen2_5_omni_proc():
    return _processor(FAMILIES["qwen2_5_omni"])


@pytest.fixture(scope="module")
def qwen3_omni_proc():
    return _processor(FAMILIES["qwen3_omni"])


@pytest.fixture(scope="module")
def qwen2_5_omni_ref():
    return _reference(FAMILIES["qwen2_5_omni"])


@pytest.fixture(scope="module")
def qwen3_omni_ref():
    return _reference(FAMILIES["qwen3_omni"])


@pytest.fixture(params=list(FAMILIES))
def family(request) -> Family:
    return FAMILIES[request.param]


@pytest.fixture
def proc(family, request):
    return request.getfixturevalue(f"{family.name}_proc")


@pytest.fixture
def tok(proc):
    return proc.tokenizer


@pytest.fixture
def ref(family, request):
    return request.getfixturevalue(f"{family.name}_ref")


# conftest marks tests `torch` by the names of the fixtures they take: those taking these two
# (looked up by family) carry the mark themselves.
@pytest.fixture
def hf_dir(family, request):
    return request.getfixturevalue(f"{family.name}_hf_dir")


@pytest.fixture
def hf_model(family, request):
    return request.getfixturevalue(f"{family.name}_hf_model")


def _write_video(path: str, seconds: float, fps: int, size: int = 32, audio_rate: int | None = 44100) -> str:
    """A small video: frame i is a flat grey of level 10*i (so sampling is visible), plus a 440 Hz tone."""
    import av

    out = av.open(path, "w")
    vs = out.add_stream("mpeg4", rate=fps)
    vs.width = vs.height = size
    vs.pix_fmt = "yuv420p"
    a_s = None
    if audio_rate:
        a_s = out.add_stream("pcm_s16le", rate=audio_rate)
        a_s.layout = "mono"
    for i in range(int(seconds * fps)):
        frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), 10 * i, np.uint8), format="rgb24")
        for p in vs.encode(frame):
            out.mux(p)
    for p in vs.encode():
        out.mux(p)
    if a_s is not None:
        n = int(seconds * audio_rate)
        tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(n) / audio_rate) * 32767).astype(np.int16)
        for k in range(0, n, 1024):
            fr = av.AudioFrame.from_ndarray(tone[None, k:k + 1024].copy(), format="s16", layout="mono")
            fr.sample_rate, fr.pts = audio_rate, k
            for p in a_s.encode(fr):
                out.mux(p)
        for p in a_s.encode():
            out.mux(p)
    out.close()
    return path


def _write_wav(path: str, samples: np.ndarray, rate: int) -> str:
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return path


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)
    from PIL import Image

    Image.fromarray(rng.integers(0, 256, (45, 70, 3), dtype=np.uint8)).save(d / "img.png")
    tone = (0.25 * np.sin(2 * np.pi * 440 * np.arange(66150) / 44100) * 32767).astype(np.int16)  # 1.5 s
    _write_wav(str(d / "tone44k.wav"), tone, 44100)
    _write_video(str(d / "clip.mkv"), seconds=5, fps=4)
    _write_video(str(d / "silent.mkv"), seconds=2, fps=10, audio_rate=None)
    (d / "notes.txt").write_text("not a media file")
    return d


# ---------------------------------------------------------------------------------------- reference
def _hf_audio(ref, waves):
    """The processor's `_process_audio` with its audio kwargs (Qwen2.5: every clip padded to 300 s;
    Qwen3: to the longest): each clip's valid feature frames, and token counts."""
    out, _ = ref.P._process_audio(ref.me, waves, **ref.P.audio_kwargs, return_tensors="np")
    lens = out["feature_attention_mask"].sum(-1)
    out["feats"] = [f[:, :n] for f, n in zip(out["input_features"], lens)]
    return out


def _chat(role: str, text: str) -> str:
    """One turn as both chat templates write it."""
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def _render(family: Family, tok, messages) -> str:
    return tok.apply_chat_template(messages, chat_template=family.chat_template, add_generation_prompt=True,
                                   tokenize=False)


def _expand_text(family: Family, text: str, replacements: dict[str, list[str]]) -> str:
    """get_text_with_replacements: the i-th placeholder of a modality takes its i-th replacement."""
    its = {k: iter(v) for k, v in replacements.items()}
    pattern = "|".join(re.escape(family.marks[f"{kind}_token"]) for kind in ("image", "audio", "video"))
    return re.sub(pattern, lambda m: next(its[m.group(0)]), text)


def _hf_video_pixels(ip, frames: np.ndarray, min_pixels: int, max_pixels: int):
    """Frames resized / rescaled / normalised by the image processor's own steps, then laid out
    with Qwen2VLVideoProcessor.patchify's view/permute (last frame repeated to an even count)."""
    from PIL import Image
    from transformers.image_utils import SizeDict

    patch = ip.patch_size
    size = SizeDict(shortest_edge=min_pixels, longest_edge=max_pixels)
    imgs = []
    for f in frames:
        x = ip.process_image(Image.fromarray(f))
        x = ip.resize(x, size=size, resample=ip.resample, factor=patch * ip.merge_size)
        imgs.append(np.asarray(ip.normalize(ip.rescale(x, ip.rescale_factor), ip.image_mean, ip.image_std), np.float32))
    v = torch.from_numpy(np.stack(imgs))[None]
    if v.shape[1] % 2:
        v = torch.cat([v, v[:, -1:]], dim=1)
    b, t, c, h, w = v.shape
    gt, gh, gw = t // 2, h // patch, w // patch
    p = v.view(b, gt, 2, c, gh // 2, 2, patch, gw // 2, 2, patch).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return p.reshape(gt * gh * gw, c * 2 * patch * patch).numpy(), np.array([gt, gh, gw])


def _rope_matches(family: Family, hf_model, proc, ids, mm: MultiModalPayload):
    """Our rope index of the ids equals transformers' thinker get_rope_index (positions and delta)."""
    frames = [f.shape[1] for f in mm.audio_features]
    ours, delta = family.rope_index(
        ids, proc, image_grid_thw=mm.image_grid_thw, video_grid_thw=mm.video_grid_thw,
        audio_seqlens=np.array(frames) if frames else None, second_per_grids=mm.video_second_per_grid,
        use_audio_in_video=mm.use_audio_in_video)

    def t(a):
        return None if a is None else torch.tensor(np.asarray(a))

    ref, ref_delta = hf_model.thinker.get_rope_index(
        torch.tensor(ids, dtype=torch.long)[None], t(mm.image_grid_thw), t(mm.video_grid_thw),
        torch.ones(1, len(ids), dtype=torch.long), mm.use_audio_in_video, t(frames) if frames else None,
        t(mm.video_second_per_grid))
    np.testing.assert_array_equal(ours, ref[:, 0].numpy())
    assert delta == int(ref_delta.reshape(-1)[0])


# ---------------------------------------------------------------------------------------- parity
@pytest.mark.torch
def test_image_audio_messages_match_hf(family, tok, proc, ref, hf_model, media_dir):
    from PIL import Image

    rng = np.random.default_rng(1)
    img_a = Image.fromarray(rng.integers(0, 256, (300, 200, 3), dtype=np.uint8))
    img_b = str(media_dir / "img.png")
    # Lengths not multiples of the hop, the longer one over 2 chunks of 100 frames: Qwen3 pads
    # the shorter to the longer, as its processor batches them.
    wave_a = (0.1 * rng.standard_normal(16000 * 3 + 77)).astype(np.float32)
    wave_b = (0.05 * rng.standard_normal(9050)).astype(np.float32)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "Compare "}, {"type": "image", "image": img_a},
            {"type": "audio", "audio": (wave_a, 16000)}, {"type": "text", "text": " and "},
            {"type": "image", "image": img_b}, {"type": "audio", "audio": (wave_b, 16000)}]},
    ]
    out = proc.process({"messages": messages})
    mm = out.multi_modal

    # Reference: template text, then each placeholder expanded by the processor's own rule.
    P, me = ref.P, ref.me
    images = ref.ip(images=[img_a, Image.open(img_b).convert("RGB")], return_tensors="np")
    audio = _hf_audio(ref, [wave_a, wave_b])
    assert audio["num_audio_tokens"].tolist() == family.pair_tokens
    text = _expand_text(family, _render(family, tok, messages), {
        family.marks["image_token"]: [P.replace_image_token(me, images, i) for i in range(2)],
        family.marks["audio_token"]: [P.replace_audio_token(me, audio, i) for i in range(2)],
    })
    assert text.startswith(_chat("system", "Be brief.") + "<|im_start|>user\nCompare "
                           + family.marks["vision_bos_token"])
    ref_ids = tok(text, add_special_tokens=False)["input_ids"]

    assert out.prompt_token_ids.dtype == np.int32
    np.testing.assert_array_equal(out.prompt_token_ids, ref_ids)
    assert isinstance(mm, MultiModalPayload) and not mm.use_audio_in_video and mm.pixel_values_videos is None
    np.testing.assert_array_equal(mm.image_grid_thw, images["image_grid_thw"])
    np.testing.assert_array_equal(mm.pixel_values, images["pixel_values"])
    assert mm.pixel_values.dtype == np.float32 and mm.pixel_values.shape[1] == 3 * 2 * family.patch ** 2
    assert [f.shape[1] for f in mm.audio_features] == family.pair_frames
    for ours, r in zip(mm.audio_features, audio["feats"]):
        assert ours.dtype == np.float32 and ours.shape == r.shape and ours.shape[0] == 128
        np.testing.assert_allclose(ours, r, atol=1e-6, rtol=0)
    _rope_matches(family, hf_model, proc, out.prompt_token_ids, mm)

    # A clip alone: Qwen3 does not pad it at all (padding=True on a batch of one).
    lone = proc.process({"messages": [{"role": "user", "content": [{"type": "audio", "audio": (wave_b, 16000)}]}]})
    r = _hf_audio(ref, [wave_b])
    np.testing.assert_allclose(lone.multi_modal.audio_features[0], r["feats"][0], atol=1e-6, rtol=0)
    assert lone.multi_modal.audio_features[0].shape[1] == family.lone_frames
    assert int((lone.prompt_token_ids == family.ids.AUDIO_TOKEN).sum()) == int(r["num_audio_tokens"][0])


@pytest.mark.torch
@pytest.mark.parametrize("use_audio_in_video", [False, True])
def test_video_matches_hf(use_audio_in_video, family, tok, proc, ref, hf_model, media_dir):
    from PIL import Image

    path = str(media_dir / "clip.mkv")  # 5 s at 4 fps, with a 44.1 kHz track
    lone = (0.1 * np.random.default_rng(3).standard_normal(16000 + 3)).astype(np.float32)
    img = str(media_dir / "img.png")
    messages = [{"role": "user", "content": [
        {"type": "audio", "audio": (lone, 16000)}, {"type": "text", "text": "and"},
        {"type": "video", "video": path}, {"type": "image", "image": img},
        {"type": "text", "text": "What happens?"}]}]
    out = proc.process({"messages": messages, "use_audio_in_video": use_audio_in_video})
    mm, ids = out.multi_modal, out.prompt_token_ids
    assert mm.use_audio_in_video == use_audio_in_video

    clip = load_video(path, with_audio=True)
    pix, grid = _hf_video_pixels(ref.ip, clip.frames, *family.video_pixels)
    np.testing.assert_array_equal(mm.video_grid_thw, [grid])
    assert grid[0] == 5  # 10 frames sampled at 2 fps
    np.testing.assert_allclose(mm.pixel_values_videos, pix, atol=1e-6, rtol=0)
    np.testing.assert_allclose(mm.video_second_per_grid, [1.0])
    # The video as decoded frames with their rate and track gives the same prompt.
    as_frames = {"type": "video", "video": list(clip.frames), "fps": clip.fps, "audio": (clip.audio, 16000)}
    again = proc.process({"messages": [{"role": "user", "content": [
        as_frames if part["type"] == "video" else part for part in messages[0]["content"]]}],
        "use_audio_in_video": use_audio_in_video})
    np.testing.assert_array_equal(again.prompt_token_ids, ids)
    np.testing.assert_array_equal(again.multi_modal.pixel_values_videos, mm.pixel_values_videos)
    assert len(again.multi_modal.audio_features) == len(mm.audio_features)
    for a, b in zip(again.multi_modal.audio_features, mm.audio_features):
        np.testing.assert_array_equal(a, b)

    # Audio in prompt order: the lone clip, then the video's track (not loaded without use_audio_in_video).
    P, me = ref.P, ref.me
    waves = [lone, clip.audio] if use_audio_in_video else [lone]
    audio = _hf_audio(ref, waves)
    assert len(mm.audio_features) == len(waves)
    for ours, r in zip(mm.audio_features, audio["feats"]):
        np.testing.assert_allclose(ours, r, atol=1e-6, rtol=0)
    video_inputs = {"video_grid_thw": [grid], "video_second_per_grid": [2 / clip.fps]}
    if use_audio_in_video:
        video = P.replace_video_with_audio_token(me, video_inputs, 0, audio, 1,
                                                 position_id_per_seconds=P.position_id_per_seconds,
                                                 seconds_per_chunk=P.seconds_per_chunk)
    else:
        video = family.marks["video_token"] * (int(np.prod(grid)) // MERGE ** 2)
    images = ref.ip(images=[Image.open(img).convert("RGB")], return_tensors="np")
    text = _expand_text(family, _render(family, tok, messages), {
        family.marks["audio_token"]: [P.replace_audio_token(me, audio, 0)],
        family.marks["video_token"]: [video],
        family.marks["image_token"]: [P.replace_image_token(me, images, 0)],
    })
    np.testing.assert_array_equal(ids, tok(text, add_special_tokens=False)["input_ids"])
    if use_audio_in_video:
        # <vision_start><audio_start> ... <audio_end><vision_end>, the two streams really interleaved:
        # video, audio, video, ... past the lone clip's tokens.
        start = int(np.flatnonzero(ids == family.ids.VISION_START)[0])
        assert ids[start + 1] == family.ids.AUDIO_START
        body = ids[np.isin(ids, [family.ids.VIDEO_TOKEN, family.ids.AUDIO_TOKEN])][int(audio["num_audio_tokens"][0]):]
        assert body[0] == family.ids.VIDEO_TOKEN
        assert len(np.flatnonzero(np.diff(body) != 0)) == 2 * family.video_runs - 1
    _rope_matches(family, hf_model, proc, ids, mm)


def test_video_frames_list(family, proc):
    rng = np.random.default_rng(4)
    frames = [rng.integers(0, 256, (40, 60, 3), dtype=np.uint8) for _ in range(6)]
    track = (0.1 * rng.standard_normal(48000)).astype(np.float32)  # 3 s at 16 kHz
    out = proc.process({"messages": [{"role": "user", "content": [
        {"type": "video", "video": frames, "fps": 2.0, "audio": (track, 16000)}]}], "use_audio_in_video": True})
    mm = out.multi_modal
    assert mm.video_grid_thw[0, 0] == 3 and mm.video_second_per_grid[0] == pytest.approx(1.0)
    assert len(mm.audio_features) == 1 and mm.audio_features[0].shape == (128, 300)
    # Two identical frames make one temporal patch equal to the image processor's output for that frame.
    video = family.triple("video")
    twin = proc.process({"prompt": video, "multi_modal_data": {"video": np.stack([frames[0], frames[0]])}}).multi_modal
    lo, hi = family.video_pixels
    lone = proc.image_processor(images=[frames[0]], size={"shortest_edge": lo, "longest_edge": hi},
                                return_tensors="np")
    np.testing.assert_array_equal(twin.pixel_values_videos, lone["pixel_values"])
    # Too many frames are thinned to max_frames; an odd count pads the last temporal patch.
    small = family.processor(proc.tokenizer, VOCAB, video_max_frames=4)
    thin = small.process({"prompt": video, "multi_modal_data": {"video": [{"video": frames, "fps": 2.0}]}}).multi_modal
    assert thin.video_grid_thw[0, 0] == 2 and thin.video_second_per_grid[0] == pytest.approx(1.5)  # 4 frames over 3 s
    odd = proc.process({"prompt": video, "multi_modal_data": {"video": frames[:3]}}).multi_modal
    assert odd.video_grid_thw[0, 0] == 2


# ---------------------------------------------------------------------------------------- prompt forms
def test_prompt_with_multi_modal_data_equals_messages(family, proc, media_dir):
    rng = np.random.default_rng(2)
    wav = (0.1 * rng.standard_normal(20000)).astype(np.float32)
    img = str(media_dir / "img.png")
    via_messages = proc.process({"messages": [{"role": "user", "content": [
        {"type": "audio", "audio": (wav, 16000)}, {"type": "image", "image": img},
        {"type": "text", "text": "hi"}]}]})
    text = proc.render_chat([{"role": "user", "content": [{"type": "audio"}, {"type": "image"},
                                                           {"type": "text", "text": "hi"}]}])
    assert text.count(family.marks["audio_token"]) == 1 and text.count(family.marks["image_token"]) == 1
    via_prompt = proc.process({"prompt": text, "multi_modal_data": {"image": img, "audio": (wav, 16000)}})
    via_ids = proc.process({"prompt_token_ids": proc._encode(text).tolist(),
                            "multi_modal_data": {"image": [img], "audio": [(wav, 16000)]}})
    for other in (via_prompt, via_ids):
        np.testing.assert_array_equal(other.prompt_token_ids, via_messages.prompt_token_ids)
        np.testing.assert_array_equal(other.multi_modal.pixel_values, via_messages.multi_modal.pixel_values)
        np.testing.assert_array_equal(other.multi_modal.audio_features[0], via_messages.multi_modal.audio_features[0])
    # A ready payload is passed on untouched, and text prompts carry none.
    ready = MultiModalPayload(audio_features=[np.zeros((128, 40), np.float32)])
    assert proc.process({"prompt": "x", "multi_modal_data": ready}).multi_modal is ready
    assert proc.process("plain text").multi_modal is None


def test_image_sources_agree(family, proc, media_dir):
    from PIL import Image

    path = str(media_dir / "img.png")
    pil = Image.open(path)
    arr = np.asarray(pil.convert("RGB"))
    data_url = "data:image/png;base64," + base64.b64encode(open(path, "rb").read()).decode()
    sources = [
        {"type": "image", "image": path}, {"type": "image", "image": pil}, {"type": "image", "image": arr},
        {"type": "image", "image": arr.transpose(2, 0, 1)}, {"type": "image", "image": arr / 255.0},
        {"type": "image_url", "image_url": {"url": data_url}}, {"type": "image_url", "image_url": "file://" + path},
        {"image": path},
    ]
    outs = [proc.process({"messages": [{"role": "user", "content": [s]}]}) for s in sources]
    for o in outs[1:]:
        np.testing.assert_array_equal(o.prompt_token_ids, outs[0].prompt_token_ids)
        np.testing.assert_array_equal(o.multi_modal.pixel_values, outs[0].multi_modal.pixel_values)
    np.testing.assert_array_equal(outs[0].multi_modal.image_grid_thw, family.img_png_grid)


def test_an_image_is_resized_to_one_vision_encoder_call(family, ref):
    """`max_image_patches` (OmniJax: the thinker's largest vision bucket) lowers the image
    processor's max_pixels: a large photo is resized as transformers resizes it at that max_pixels,
    not refused; smaller images are untouched."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    photo = Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 400, 3), dtype=np.uint8))
    small = Image.fromarray(np.random.default_rng(1).integers(0, 256, (45, 70, 3), dtype=np.uint8))
    capped = family.processor(family.build_tokenizer(), VOCAB, max_image_patches=64)
    whole = family.processor(family.build_tokenizer(), VOCAB)
    got = capped.process(_user({"type": "image", "image": photo})).multi_modal
    assert int(np.prod(got.image_grid_thw)) <= 64 < int(np.prod(
        whole.process(_user({"type": "image", "image": photo})).multi_modal.image_grid_thw))
    ip = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=64 * family.patch ** 2, patch_size=family.patch,
                                  temporal_patch_size=2, merge_size=MERGE, image_mean=ref.ip.image_mean,
                                  image_std=ref.ip.image_std)
    want = ip(images=[photo], return_tensors="np")
    np.testing.assert_array_equal(got.image_grid_thw, want["image_grid_thw"])
    np.testing.assert_allclose(got.pixel_values, want["pixel_values"], atol=1e-6, rtol=0)
    for p in (capped, whole):
        np.testing.assert_array_equal(p.process(_user({"type": "image", "image": small})).multi_modal.image_grid_thw,
                                      family.img_png_grid)


def test_audio_sources_agree(family, proc, media_dir):
    """A 44.1 kHz wav as a path, OpenAI input_audio and a data URL give the same features."""
    path = str(media_dir / "tone44k.wav")
    b64 = base64.b64encode(open(path, "rb").read()).decode()
    outs = [proc.process({"messages": [{"role": "user", "content": [part]}]}) for part in (
        {"type": "audio", "audio": path},
        {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + b64}})]
    for o in outs:
        assert o.multi_modal.audio_features[0].shape == (128, 150)  # 1.5 s
        assert int((o.prompt_token_ids == family.ids.AUDIO_TOKEN).sum()) == family.tone_tokens
        np.testing.assert_array_equal(o.multi_modal.audio_features[0], outs[0].multi_modal.audio_features[0])


def _counting(monkeypatch, proc, *names) -> dict[str, int]:
    """Count the calls of the processor's media steps `names`."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        def counted(*args, _name=name, _fn=getattr(proc, name)):
            calls[_name] += 1
            return _fn(*args)
        monkeypatch.setattr(proc, name, counted)
    return calls


def _data_url(path) -> str:
    return "data:image/png;base64," + base64.b64encode(open(path, "rb").read()).decode()


def test_a_conversation_processes_each_media_item_once(family, media_dir, monkeypatch, tmp_path):
    """A chat API sends a conversation whole each turn: an item whose source carries its content
    (a data: URL, OpenAI's input_audio bytes, a waveform) is loaded and processed once, and read
    back at the next turns, equal to processing it afresh; its digests come along (a stage need
    not hash it again). Qwen3 pads every clip to the prompt's longest (transformers'
    padding=True): a longer clip makes the earlier ones' features again."""
    from PIL import Image

    proc = family.processor(family.build_tokenizer(), VOCAB)
    calls = _counting(monkeypatch, proc, "image_inputs", "audio_features", "_load")
    rng = np.random.default_rng(5)
    wav1, wav2 = ((0.1 * rng.standard_normal(n)).astype(np.float32) for n in (16000, 24000))
    Image.fromarray(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)).save(tmp_path / "other.png")
    turn1 = [{"role": "user", "content": [{"type": "audio", "audio": (wav1, 16000)},
                                          {"type": "image_url", "image_url": {"url": _data_url(media_dir / "img.png")}},
                                          {"type": "text", "text": "what is this?"}]}]
    wav2_b64 = base64.b64encode(open(_write_wav(str(tmp_path / "two.wav"), wav2 * 32767, 16000), "rb").read()).decode()
    turn2 = turn1 + [{"role": "assistant", "content": "a picture"},
                     {"role": "user", "content": [
                         {"type": "image_url", "image_url": {"url": _data_url(tmp_path / "other.png")}},
                         {"type": "input_audio", "input_audio": {"data": wav2_b64, "format": "wav"}}]}]
    proc.process({"messages": turn1})
    assert calls == {"image_inputs": 1, "audio_features": 1, "_load": 2}
    got = proc.process({"messages": turn2})
    # the new image and clip; Qwen3: the first clip again, padded to the new longest
    assert calls == {"image_inputs": 2, "audio_features": 3 if family.name == "qwen3_omni" else 2, "_load": 4}
    before = dict(calls)
    again = proc.process({"messages": turn2})
    assert calls == before

    fresh = family.processor(family.build_tokenizer(), VOCAB, media_cache_bytes=0).process({"messages": turn2})
    for out in (got, again):
        np.testing.assert_array_equal(out.prompt_token_ids, fresh.prompt_token_ids)
        mm, want = out.multi_modal, fresh.multi_modal
        np.testing.assert_array_equal(mm.pixel_values, want.pixel_values)
        np.testing.assert_array_equal(mm.image_grid_thw, want.image_grid_thw)
        assert len(mm.audio_features) == 2
        for a, b in zip(mm.audio_features, want.audio_features):
            np.testing.assert_array_equal(a, b)
        bare = MultiModalPayload(audio_features=want.audio_features, pixel_values=want.pixel_values,
                                 image_grid_thw=want.image_grid_thw)
        assert mm.digests == bare.item_digests() and set(mm.digests) == {"audio", "image"}
        assert mm.item_hashes(b"pad") == bare.item_hashes(b"pad") != bare.item_hashes()


def test_media_named_by_a_path_are_read_each_time(family, tmp_path):
    """A file may change under its name: a path is loaded again at each prompt."""
    from PIL import Image

    proc = family.processor(family.build_tokenizer(), VOCAB)
    path = tmp_path / "frame.png"
    outs = []
    for seed in (1, 2):
        Image.fromarray(np.random.default_rng(seed).integers(0, 256, (45, 70, 3), dtype=np.uint8)).save(path)
        outs.append(proc.process(_user({"type": "image", "image": str(path)})).multi_modal)
    assert not np.array_equal(outs[0].pixel_values, outs[1].pixel_values)
    assert outs[0].digests["image"] != outs[1].digests["image"]


def test_the_processed_media_cache_keeps_to_its_budget(family):
    """Past `media_cache_bytes` the least recently used items go; what is read back stays right."""
    def clips(proc) -> list[np.ndarray]:
        waves = [(0.1 * np.random.default_rng(seed).standard_normal(16000)).astype(np.float32) for seed in (1, 2, 3, 1)]
        return [proc.process(_user({"type": "audio", "audio": (w, 16000)})).multi_modal.audio_features[0]
                for w in waves]

    whole = family.processor(family.build_tokenizer(), VOCAB)
    want = clips(whole)
    assert len(whole.processed) == 6  # three clips' waveforms and features
    one_clip = whole.processed.bytes // 3
    small = family.processor(family.build_tokenizer(), VOCAB, media_cache_bytes=one_clip)
    got = clips(small)
    assert small.processed.bytes <= one_clip and len(small.processed) == 2
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_a_payload_with_wrong_digests_is_refused():
    mm = MultiModalPayload(audio_features=[np.zeros((128, 40), np.float32)] * 2, digests={"audio": ["x"]})
    with pytest.raises(ValueError, match=r"2 audio item\(s\) but 1 audio digest"):
        mm.item_hashes()


def test_media_that_makes_a_prompt_too_long_is_refused_as_too_long(family, proc, media_dir):
    """The length is checked again once the media is expanded: a prompt that fits as text but not
    with its audio is a PromptTooLongError (a server's context_length_exceeded), not a request
    the first stage refuses later."""
    prompt = _user({"type": "audio", "audio": str(media_dir / "tone44k.wav")}, {"type": "text", "text": "Hi"})
    n = proc.process(prompt).prompt_token_ids.size
    assert proc.process(prompt, max_prompt_len=n).prompt_token_ids.size == n
    with pytest.raises(PromptTooLongError, match=f"with its media it has {n} tokens; a prompt may have at most {n - 1}"):
        proc.process(prompt, max_prompt_len=n - 1)


def test_speech_output_system_prompt(family, proc):
    """speech_output puts the family's talker system prompt (Qwen2.5's; Qwen3 has none) first,
    unless the chat has its own system message."""
    msgs = [{"role": "user", "content": "Say hi."}]
    rest = _chat("user", "Say hi.") + "<|im_start|>assistant\n"
    default = _chat("system", family.system) if family.system else ""

    def decoded(messages, speech):
        return proc.tokenizer.decode(proc.process({"messages": messages}, speech_output=speech).prompt_token_ids)

    spoken = _chat("system", family.speech_system) if family.speech_system else default
    assert decoded(msgs, True) == spoken + rest
    assert decoded(msgs, False) == default + rest
    assert decoded([{"role": "system", "content": "Be terse."}] + msgs, True) == _chat("system", "Be terse.") + rest


def test_placeholders_typed_in_chat_text_stay_text(family, proc):
    """Placeholder strings typed by a user are text, not media slots or turn ends."""
    typed = f"see {family.triple('image')} and <|im_end|>"
    ids = proc.process({"messages": [{"role": "user", "content": typed}]}).prompt_token_ids
    expected = (_chat("system", family.system) if family.system else "") + _chat("user", typed)
    assert family.ids.IMAGE_TOKEN not in ids
    assert proc.tokenizer.decode(ids) == expected + "<|im_start|>assistant\n"
    # Only the template's turn ends are the special token.
    assert (ids == family.ids.IM_END).sum() == expected.count("<|im_end|>") - 1


# ---------------------------------------------------------------------------------------- media
def test_audio_resampled_from_44k(media_dir):
    path = str(media_dir / "tone44k.wav")
    wav = load_audio(path)
    assert wav.dtype == np.float32 and wav.shape == (24000,)  # 1.5 s at 16 kHz
    spectrum = np.abs(np.fft.rfft(wav))
    assert abs(np.argmax(spectrum) * 16000 / len(wav) - 440) < 2  # the tone survives resampling
    with wave.open(path) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    np.testing.assert_allclose(load_audio((pcm, 44100)), wav, atol=1e-6)
    stereo = np.stack([pcm, pcm], axis=1)  # [n, 2] is downmixed
    np.testing.assert_allclose(load_audio({"array": stereo, "sampling_rate": 44100}), wav, atol=1e-6)


def test_video_file_sampling(media_dir):
    path = str(media_dir / "clip.mkv")  # 5 s, 4 fps, 20 frames of grey level 10*i
    assert sample_frame_indices(20, 4.0, 2.0, 4, 768).tolist() == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18]
    clip = load_video(path)
    assert clip.frames.shape == (10, 32, 32, 3) and clip.fps == pytest.approx(2.0) and clip.audio is None
    np.testing.assert_allclose(clip.frames[:, 16, 16, 0], 10 * np.arange(0, 20, 2), atol=4)
    few = load_video(path, max_frames=4)
    assert few.frames.shape[0] == 4 and few.fps == pytest.approx(0.8)
    np.testing.assert_allclose(few.frames[:, 16, 16, 0], [0, 50, 100, 150], atol=4)
    with_audio = load_video(path, with_audio=True)
    assert with_audio.audio.shape == (80000,)  # the 44.1 kHz track at 16 kHz
    assert load_video(str(media_dir / "silent.mkv"), with_audio=True).audio is None


# ---------------------------------------------------------------------------------------- checkpoints
@pytest.mark.torch
def test_from_checkpoint(family, tok, hf_dir, tmp_path):
    """A converted checkpoint (omni_jax_config.json names the family) and an HF directory (config.json's
    model_type) give the family's processor, with the tokenizer, config and preprocessor_config.json."""
    hf = json.load(open(f"{hf_dir}/config.json"))
    side = MERGE * family.patch
    pre = {"patch_size": family.patch, "max_pixels": side * side * 6, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    conv, hf_copy = tmp_path / "converted", tmp_path / "hf"
    for d in (conv, hf_copy):
        d.mkdir()
        (d / "preprocessor_config.json").write_text(json.dumps(pre))
    tok.save_pretrained(str(conv))
    (conv / "omni_jax_config.json").write_text(json.dumps({"format_version": 1, "family": family.name,
                                                           "hf_config": hf}))
    (hf_copy / "config.json").write_text(json.dumps(hf))
    img = np.full((400, 300, 3), 255, np.uint8)
    # The HF directory goes without a tokenizer (the same files, and loading them is this test's
    # slowest step): it takes a pre-tokenized prompt.
    prompts = {conv: {"messages": [{"role": "user", "content": [{"type": "image", "image": img}]}]},
               hf_copy: {"prompt_token_ids": [family.ids.VISION_START, family.ids.IMAGE_TOKEN, family.ids.VISION_END],
                         "multi_modal_data": {"image": img}}}
    for d, prompt in prompts.items():
        p = prompt_processor(str(d))
        assert type(p) is family.processor and p.vocab_size == VOCAB
        assert {k: getattr(p, k) for k in family.hf_options} == family.hf_options
        assert (p.tokens.image_token_id, p.tokens.audio_token_id, p.tokens.audio_start_token_id,
                p.tokens.position_id_per_seconds) == (family.ids.IMAGE_TOKEN, family.ids.AUDIO_TOKEN,
                                                      family.ids.AUDIO_START, family.position_id_per_seconds)
        assert p.patch_size == family.patch and p.SPEECH_SYSTEM_PROMPT == family.speech_system
        mm = p.process(prompt).multi_modal
        assert int(np.prod(mm.image_grid_thw)) * family.patch ** 2 <= side * side * 6
        np.testing.assert_allclose(mm.pixel_values, 1.0)  # white with mean 0.5 / std 0.5
    # A `size` dict replaces the default pixel range.
    sized = family.processor(tok, VOCAB, preprocessor_config={"size": {"shortest_edge": 100, "longest_edge": 5000}},
                             video_preprocessor_config={"size": {"shortest_edge": 200, "longest_edge": 6000}})
    assert (sized.image_processor.size.shortest_edge, sized.image_processor.size.longest_edge) == (100, 5000)
    assert sized.video_pixels == (200, 6000)


# ---------------------------------------------------------------------------------------- bad inputs
def _user(*parts):
    return {"messages": [{"role": "user", "content": list(parts)}]}


def test_hostile_numbers_fail_fast(proc):
    """Values that used to wrap or hang are refused with an error naming them."""
    for rate in (float("inf"), 1e30, float("nan"), -16000):
        with pytest.raises(PromptError, match="sample rate"):
            proc.process(_user({"type": "audio", "audio": (np.zeros(1600, np.float32), rate)}))
    for ids in ([2**31], [1, 2**40], np.array([2**63], np.uint64), [-1]):
        with pytest.raises(PromptError, match="out of range"):
            proc.process({"prompt_token_ids": ids})


def test_bad_inputs(family, proc, media_dir, tmp_path):
    missing = str(tmp_path / "nope.png")
    with pytest.raises(PromptError, match=re.escape(missing)):
        proc.process(_user({"type": "image", "image": missing}))
    notes = str(media_dir / "notes.txt")
    with pytest.raises(PromptError, match=r"messages\[0\]\.content\[0\]: cannot read image .*notes\.txt"):
        proc.process(_user({"type": "image", "image": notes}))
    with pytest.raises(PromptError, match=r"cannot read audio .*notes\.txt"):
        proc.process(_user({"type": "audio", "audio": notes}))
    with pytest.raises(PromptError, match=r"cannot read video .*notes\.txt"):
        proc.process(_user({"type": "video", "video": notes}))
    with pytest.raises(PromptError, match=r"unknown part type 'file'"):
        proc.process(_user({"type": "text", "text": "x"}, {"type": "file", "file": "a.pdf"}))
    with pytest.raises(PromptError, match="remote URLs"):
        proc.process(_user({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}))
    with pytest.raises(PromptError, match="sample rate"):
        proc.process(_user({"type": "audio", "audio": np.zeros(16000, np.float32)}))
    strict = family.processor(proc.tokenizer, VOCAB, max_audio_seconds=2, max_video_seconds=3)
    with pytest.raises(PromptError, match=r"lasts 5\.00 s, longer than the limit of 2 s"):
        strict.process(_user({"type": "audio", "audio": (np.zeros(80000, np.float32), 16000)}))
    with pytest.raises(PromptError, match=r"video .*clip\.mkv.* lasts 5\.00 s, longer than the limit of 3 s"):
        strict.process(_user({"type": "video", "video": str(media_dir / "clip.mkv")}))
    # Too short for one token; Qwen3's 150 samples also leave its STFT nothing to reflect.
    for n in (100, 150):
        with pytest.raises(PromptError, match=r"messages\[0\]\.content\[0\]: audio is too short"):
            proc.process(_user({"type": "audio", "audio": (np.zeros(n, np.float32), 16000)}))
    image = re.escape(family.marks["image_token"])
    with pytest.raises(PromptError, match=rf"1 {image} placeholder\(s\) but multi_modal_data gives 2 image"):
        proc.process({"prompt": family.triple("image"),
                      "multi_modal_data": {"image": [np.zeros((32, 32, 3), np.uint8)] * 2}})
    with pytest.raises(PromptError, match="must be written as " + re.escape(family.triple("audio"))):
        proc.process({"prompt": f"listen {family.marks['audio_token']}",
                      "multi_modal_data": {"audio": (np.zeros(16000), 16000)}})
    with pytest.raises(PromptError, match="unknown multi_modal_data key"):
        proc.process({"prompt": "x", "multi_modal_data": {"pdf": 1}})
    with pytest.raises(PromptError, match="use_audio_in_video"):
        proc.process({"prompt": "x", "use_audio_in_video": "yes"})
    with pytest.raises(PromptError, match=r"messages\[0\]\.content\[1\]: cannot process this image: .*aspect ratio"):
        proc.process(_user({"type": "text", "text": "x"}, {"type": "image", "image": np.zeros((2, 600, 3), np.uint8)}))
    with pytest.raises(PromptError, match="same size"):
        proc.process(_user({"type": "video", "video": [np.zeros((28, 28, 3), np.uint8), np.zeros((30, 28, 3), np.uint8)]}))


# ---------------------------------------------------------------------------------------- end to end
@pytest.mark.e2e
def test_qwen3_image_audio_chat_matches_transformers(qwen3_omni_hf_dir, qwen3_omni_hf_model, qwen3_omni_proc, tmp_path):
    """Qwen3-Omni through OmniJax generates what transformers' thinker does for an image + audio chat."""
    from PIL import Image, ImageDraw

    from conversion.convert import convert
    from omni_jax import OmniJax, SamplingParams
    from omni_jax.config import load_pipeline_config

    ckpt = convert(qwen3_omni_hf_dir, str(tmp_path / "ckpt"), dtype="float32", progress=False)
    qwen3_omni_proc.tokenizer.save_pretrained(ckpt)
    img = Image.new("RGB", (64, 96), "white")
    ImageDraw.Draw(img).ellipse((10, 10, 50, 80), fill="red")
    t = np.arange(16000 + 800) / 16000.0
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    messages = [{"role": "user", "content": [
        {"type": "image", "image": img}, {"type": "audio", "audio": (tone, 16000)},
        {"type": "text", "text": "What do you see and hear?"}]}]
    pipeline = load_pipeline_config("qwen3_omni_tiny").with_overrides(thinker=dict(
        token_buckets=[64], decode_buckets=[1], max_num_seqs=1, audio_chunk_buckets=[2], vision_patch_buckets=[64]))
    with OmniJax(model=ckpt, pipeline=pipeline) as omni:
        assert isinstance(omni.processor, Qwen3InputProcessor) and omni.processor.max_image_patches == 64
        out = omni.generate({"messages": messages}, SamplingParams(temperature=0.0, max_tokens=6))[0]
        p = omni.processor.process({"messages": messages})
    assert out.error is None, out.error
    mm = p.multi_modal
    assert int((p.prompt_token_ids == hf_tiny_qwen3.AUDIO_TOKEN).sum()) == 13 + 1  # 105 frames: one chunk + 5 frames
    ids = torch.tensor(p.prompt_token_ids, dtype=torch.long)[None]
    feats = torch.tensor(mm.audio_features[0])[None]
    with torch.no_grad():
        ref = qwen3_omni_hf_model.thinker.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids),
            input_features=feats, feature_attention_mask=torch.ones(1, feats.shape[-1], dtype=torch.long),
            pixel_values=torch.tensor(mm.pixel_values), image_grid_thw=torch.tensor(mm.image_grid_thw),
            max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out.token_ids == ref
