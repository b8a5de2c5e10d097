"""Chat messages with media -> token ids + encoder inputs (omni_jax.inputs.processor / media).

The reference is transformers' processor *parts* (the full Qwen2_5OmniProcessor needs
torchvision): the tokenizer's chat template, WhisperFeatureExtractor and
Qwen2VLImageProcessorPil with Qwen2.5-Omni-7B's preprocessor_config.json, and the placeholder
expansion methods of Qwen2_5OmniProcessor run on a stand-in `self`.
"""

from __future__ import annotations

import base64
import json
import re
import types
import wave

import numpy as np
import pytest
import torch

from omni_jax.engine.protocol import MultiModalPayload
from omni_jax.inputs.media import load_audio, load_video, sample_frame_indices
from omni_jax.models.qwen2_5_omni.processor import Qwen2_5InputProcessor
from omni_jax.errors import PromptError
from omni_jax.inputs.qwen_tokenizer import DEFAULT_SYSTEM_PROMPT, build_qwen2_5_omni_tokenizer
from omni_jax.inputs.rope_index import RopeIndexConfig
from omni_jax.models.qwen2_5_omni.rope_index import get_rope_index

pytestmark = pytest.mark.parity

VOCAB = 152064
MERGE = 2


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tok():
    return build_qwen2_5_omni_tokenizer()


@pytest.fixture(scope="module")
def proc(tok):
    return Qwen2_5InputProcessor(tok, VOCAB)


@pytest.fixture(scope="module")
def hf_parts():
    """The transformers parts with Qwen2.5-Omni-7B's preprocessor_config.json values."""
    from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=300, n_fft=400,
                                 padding_value=0.0, dither=0.0, return_attention_mask=True)
    ip = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2,
                                  merge_size=2, image_mean=[0.48145466, 0.4578275, 0.40821073],
                                  image_std=[0.26862954, 0.26130258, 0.27577711])
    return fe, ip


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
def _stand_in(tok):
    """A stand-in `self` for Qwen2_5OmniProcessor's placeholder methods (the class needs torchvision)."""
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor as P

    return types.SimpleNamespace(
        image_processor=types.SimpleNamespace(merge_size=MERGE),
        video_processor=types.SimpleNamespace(merge_size=MERGE, temporal_patch_size=2),
        image_token="<|IMAGE|>", audio_token="<|AUDIO|>", video_token="<|VIDEO|>",
        audio_bos_token="<|audio_bos|>", audio_eos_token="<|audio_eos|>",
        get_chunked_index=lambda idx, k: P.get_chunked_index(None, idx, k),
    ), P


def _hf_audio(fe, waves):
    """Qwen2_5OmniProcessor._process_audio: features padded to 300 s, mask, token counts."""
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths

    out = fe(waves, sampling_rate=16000, padding="max_length", return_attention_mask=True, return_tensors="np")
    lens = out["attention_mask"].sum(-1)
    return {"feats": [f[:, :n] for f, n in zip(out["input_features"], lens)],
            "num_audio_tokens": _get_feat_extract_output_lengths(lens)}


def _expand_text(text: str, replacements: dict[str, list[str]]) -> str:
    """get_text_with_replacements: the i-th occurrence of a placeholder takes its modality's i-th string."""
    its = {k: iter(v) for k, v in replacements.items()}
    return re.sub(r"<\|IMAGE\|>|<\|AUDIO\|>|<\|VIDEO\|>", lambda m: next(its[m.group(0)]), text)


def _hf_video_pixels(ip, frames: np.ndarray, min_pixels: int, max_pixels: int):
    """Frames resized / rescaled / normalised by the HF image processor's own steps, then laid out
    with Qwen2VLVideoProcessor.patchify's view/permute (last frame repeated to an even count)."""
    from PIL import Image
    from transformers.image_utils import SizeDict

    size = SizeDict(shortest_edge=min_pixels, longest_edge=max_pixels)
    imgs = []
    for f in frames:
        x = ip.process_image(Image.fromarray(f))
        x = ip.resize(x, size=size, resample=ip.resample, factor=28)
        x = ip.normalize(ip.rescale(x, ip.rescale_factor), ip.image_mean, ip.image_std)
        imgs.append(np.asarray(x, np.float32))
    v = torch.from_numpy(np.stack(imgs))[None]
    if v.shape[1] % 2:
        v = torch.cat([v, v[:, -1:]], dim=1)
    b, t, c, h, w = v.shape
    gt, gh, gw = t // 2, h // 14, w // 14
    p = v.view(b, gt, 2, c, gh // 2, 2, 14, gw // 2, 2, 14).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return p.reshape(gt * gh * gw, c * 2 * 14 * 14).numpy(), np.array([gt, gh, gw])


def _hf_rope(model, ids, mm: MultiModalPayload, use_audio_in_video: bool):
    pos, delta = model.thinker.model.get_rope_index(
        torch.tensor(ids, dtype=torch.long)[None],
        image_grid_thw=None if mm.image_grid_thw is None else torch.tensor(mm.image_grid_thw),
        video_grid_thw=None if mm.video_grid_thw is None else torch.tensor(mm.video_grid_thw),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        use_audio_in_video=use_audio_in_video,
        audio_seqlens=torch.tensor([f.shape[1] for f in mm.audio_features]) if mm.audio_features else None,
        second_per_grids=None if mm.video_second_per_grid is None else torch.tensor(mm.video_second_per_grid))
    return pos[:, 0].numpy(), int(delta.reshape(-1)[0])


# ---------------------------------------------------------------------------------------- parity
def test_image_audio_messages_match_hf_parts(tok, proc, hf_parts, media_dir):
    fe, ip = hf_parts
    from PIL import Image

    rng = np.random.default_rng(1)
    img_a = Image.fromarray(rng.integers(0, 256, (300, 200, 3), dtype=np.uint8))
    img_b = str(media_dir / "img.png")
    wave_a = (0.1 * rng.standard_normal(16000 * 3 + 77)).astype(np.float32)
    wave_b = (0.05 * rng.standard_normal(9000)).astype(np.float32)
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
    stand_in, P = _stand_in(tok)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = ip(images=[img_a, Image.open(img_b).convert("RGB")], return_tensors="np")
    audio = _hf_audio(fe, [wave_a, wave_b])
    text = _expand_text(text, {
        "<|IMAGE|>": [P.replace_image_token(stand_in, images, i) for i in range(2)],
        "<|AUDIO|>": [P.replace_audio_token(stand_in, audio, i) for i in range(2)],
    })
    ref_ids = tok(text, add_special_tokens=False)["input_ids"]

    assert out.prompt_token_ids.dtype == np.int32
    np.testing.assert_array_equal(out.prompt_token_ids, ref_ids)
    assert isinstance(mm, MultiModalPayload) and not mm.use_audio_in_video
    np.testing.assert_array_equal(mm.image_grid_thw, images["image_grid_thw"])
    np.testing.assert_array_equal(mm.pixel_values, images["pixel_values"])
    assert mm.pixel_values.dtype == np.float32 and mm.pixel_values.shape[1] == 1176
    assert len(mm.audio_features) == 2
    for ours, ref in zip(mm.audio_features, audio["feats"]):
        assert ours.dtype == np.float32 and ours.shape == ref.shape and ours.shape[0] == 128
        np.testing.assert_allclose(ours, ref, atol=1e-6, rtol=0)
    assert mm.pixel_values_videos is None


def test_prompt_with_multi_modal_data_equals_messages(proc, media_dir):
    rng = np.random.default_rng(2)
    wav = (0.1 * rng.standard_normal(20000)).astype(np.float32)
    img = str(media_dir / "img.png")
    via_messages = proc.process({"messages": [{"role": "user", "content": [
        {"type": "audio", "audio": (wav, 16000)}, {"type": "image", "image": img},
        {"type": "text", "text": "hi"}]}]})
    text = proc.render_chat([{"role": "user", "content": [{"type": "audio"}, {"type": "image"},
                                                           {"type": "text", "text": "hi"}]}])
    assert text.count("<|AUDIO|>") == 1 and text.count("<|IMAGE|>") == 1
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


def test_image_sources_agree(proc, media_dir):
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
    np.testing.assert_array_equal(outs[0].multi_modal.image_grid_thw, [[1, 4, 4]])  # 45x70 -> 56x56


def test_audio_resampled_from_44k(proc, media_dir):
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
    b64 = base64.b64encode(open(path, "rb").read()).decode()
    outs = [proc.process({"messages": [{"role": "user", "content": [part]}]}) for part in (
        {"type": "audio", "audio": path},
        {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + b64}})]
    for o in outs:
        assert o.multi_modal.audio_features[0].shape == (128, 150)
        assert int((o.prompt_token_ids == RopeIndexConfig().audio_token_id).sum()) == 37  # 150 frames -> 37 tokens
        np.testing.assert_array_equal(o.multi_modal.audio_features[0], outs[0].multi_modal.audio_features[0])


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


def test_video_with_audio_matches_hf_layout_and_rope(tok, proc, hf_parts, media_dir, qwen2_5_omni_hf_model):
    fe, ip = hf_parts
    path = str(media_dir / "clip.mkv")
    rng = np.random.default_rng(3)
    lone = (0.1 * rng.standard_normal(16000)).astype(np.float32)
    messages = [{"role": "user", "content": [
        {"type": "audio", "audio": (lone, 16000)}, {"type": "text", "text": "and"},
        {"type": "video", "video": path}, {"type": "image", "image": str(media_dir / "img.png")},
        {"type": "text", "text": "What happens?"}]}]
    out = proc.process({"messages": messages, "use_audio_in_video": True})
    mm = out.multi_modal
    assert mm.use_audio_in_video

    clip = load_video(path, with_audio=True)
    pix, grid = _hf_video_pixels(ip, clip.frames, 128 * 28 * 28, 768 * 28 * 28)
    np.testing.assert_array_equal(mm.video_grid_thw, [grid])
    np.testing.assert_allclose(mm.pixel_values_videos, pix, atol=1e-6, rtol=0)
    np.testing.assert_allclose(mm.video_second_per_grid, [1.0])

    # Audio list in prompt order: the lone audio, then the video's track.
    audio = _hf_audio(fe, [lone, clip.audio])
    assert len(mm.audio_features) == 2
    for ours, ref in zip(mm.audio_features, audio["feats"]):
        np.testing.assert_allclose(ours, ref, atol=1e-6, rtol=0)
    stand_in, P = _stand_in(tok)
    video_inputs = {"video_grid_thw": [grid], "video_second_per_grid": [2 / clip.fps]}
    images = ip(images=[load_image_rgb(media_dir / "img.png")], return_tensors="np")
    text = _expand_text(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), {
        "<|AUDIO|>": [P.replace_audio_token(stand_in, audio, 0)],
        "<|VIDEO|>": [P.replace_video_with_audio_token(stand_in, video_inputs, 0, audio, 1,
                                                       position_id_per_seconds=25, seconds_per_chunk=2.0)],
        "<|IMAGE|>": [P.replace_image_token(stand_in, images, 0)],
    })
    ref_ids = tok(text, add_special_tokens=False)["input_ids"]
    np.testing.assert_array_equal(out.prompt_token_ids, ref_ids)
    # 5 s of video and audio: three 2 s chunks, so the two streams really interleave.
    body = out.prompt_token_ids
    runs = np.flatnonzero(np.diff(body[np.isin(body, [151646, 151656])]) != 0)
    assert len(runs) >= 4

    ours, delta = get_rope_index(out.prompt_token_ids, RopeIndexConfig(), image_grid_thw=mm.image_grid_thw,
                                 video_grid_thw=mm.video_grid_thw,
                                 audio_seqlens=[f.shape[1] for f in mm.audio_features],
                                 second_per_grids=mm.video_second_per_grid, use_audio_in_video=True)
    ref_pos, ref_delta = _hf_rope(qwen2_5_omni_hf_model, out.prompt_token_ids, mm, True)
    np.testing.assert_array_equal(ours, ref_pos)
    assert delta == ref_delta

    # Without use_audio_in_video the video is plain and the track is not loaded.
    plain = proc.process({"messages": messages})
    assert len(plain.multi_modal.audio_features) == 1
    assert int((plain.prompt_token_ids == 151656).sum()) == int(np.prod(grid)) // 4
    pos, delta = get_rope_index(plain.prompt_token_ids, RopeIndexConfig(), plain.multi_modal.image_grid_thw,
                                plain.multi_modal.video_grid_thw, [plain.multi_modal.audio_features[0].shape[1]],
                                plain.multi_modal.video_second_per_grid)
    ref_pos, ref_delta = _hf_rope(qwen2_5_omni_hf_model, plain.prompt_token_ids, plain.multi_modal, False)
    np.testing.assert_array_equal(pos, ref_pos)


def load_image_rgb(path):
    from PIL import Image

    return Image.open(path).convert("RGB")


def test_video_frames_list(proc):
    rng = np.random.default_rng(4)
    frames = [rng.integers(0, 256, (40, 60, 3), dtype=np.uint8) for _ in range(6)]
    track = (0.1 * rng.standard_normal(48000)).astype(np.float32)  # 3 s at 16 kHz
    out = proc.process({"messages": [{"role": "user", "content": [
        {"type": "video", "video": frames, "fps": 2.0, "audio": (track, 16000)}]}], "use_audio_in_video": True})
    mm = out.multi_modal
    assert mm.video_grid_thw[0, 0] == 3 and mm.video_second_per_grid[0] == pytest.approx(1.0)
    assert len(mm.audio_features) == 1 and mm.audio_features[0].shape == (128, 300)
    # Two identical frames make one temporal patch equal to the image processor's output for that frame.
    twin = proc.process({"prompt": "<|vision_bos|><|VIDEO|><|vision_eos|>",
                         "multi_modal_data": {"video": np.stack([frames[0], frames[0]])}}).multi_modal
    lone = proc.image_processor(images=[frames[0]], size={"shortest_edge": 128 * 28 * 28,
                                                          "longest_edge": 768 * 28 * 28}, return_tensors="np")
    np.testing.assert_array_equal(twin.pixel_values_videos, lone["pixel_values"])
    # Too many frames are thinned to max_frames; an odd count pads the last temporal patch.
    small = Qwen2_5InputProcessor(proc.tokenizer, VOCAB, video_max_frames=4)
    thin = small.process({"prompt": "<|vision_bos|><|VIDEO|><|vision_eos|>",
                          "multi_modal_data": {"video": [{"video": frames, "fps": 2.0}]}}).multi_modal
    assert thin.video_grid_thw[0, 0] == 2 and thin.video_second_per_grid[0] == pytest.approx(1.5)  # 4 frames over 3 s
    odd = proc.process({"prompt": "<|vision_bos|><|VIDEO|><|vision_eos|>",
                        "multi_modal_data": {"video": frames[:3]}}).multi_modal
    assert odd.video_grid_thw[0, 0] == 2


def test_speech_system_prompt(proc):
    msgs = [{"role": "user", "content": "Say hi."}]
    spoken = proc._need_tokenizer("").decode(proc.process({"messages": msgs}, speech_output=True).prompt_token_ids)
    assert spoken.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nSay hi.")
    plain = proc._need_tokenizer("").decode(proc.process({"messages": msgs}).prompt_token_ids)
    assert "You are a helpful assistant." in plain and DEFAULT_SYSTEM_PROMPT not in plain
    own = [{"role": "system", "content": "Be terse."}] + msgs
    kept = proc._need_tokenizer("").decode(proc.process({"messages": own}, speech_output=True).prompt_token_ids)
    assert DEFAULT_SYSTEM_PROMPT not in kept and "Be terse." in kept


def test_from_checkpoint(tmp_path, tok):
    from omni_jax.models.qwen2_5_omni.tiny import tiny_config

    tok.save_pretrained(str(tmp_path))
    (tmp_path / "omni_jax_config.json").write_text(json.dumps({"format_version": 1, "hf_config": tiny_config()}))
    pre = {"feature_size": 128, "sampling_rate": 16000, "hop_length": 160, "n_fft": 400, "chunk_length": 300,
           "min_pixels": 3136, "max_pixels": 28 * 28 * 6, "patch_size": 14, "temporal_patch_size": 2,
           "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(pre))
    p = Qwen2_5InputProcessor.from_checkpoint(str(tmp_path))
    assert p.vocab_size == 152064 and p.tokens.image_token_id == 151655
    img = np.full((400, 300, 3), 255, np.uint8)
    mm = p.process({"messages": [{"role": "user", "content": [{"type": "image", "image": img}]}]}).multi_modal
    assert int(np.prod(mm.image_grid_thw)) * 14 * 14 <= 28 * 28 * 6
    np.testing.assert_allclose(mm.pixel_values, 1.0)  # white with mean 0.5 / std 0.5
    # A `size` dict replaces the default pixel range.
    sized = Qwen2_5InputProcessor(tok, VOCAB, preprocessor_config={"size": {"shortest_edge": 100, "longest_edge": 5000}},
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


def test_bad_inputs(proc, media_dir, tmp_path):
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
    strict = Qwen2_5InputProcessor(proc.tokenizer, VOCAB, max_audio_seconds=2, max_video_seconds=3)
    with pytest.raises(PromptError, match=r"lasts 5\.00 s, longer than the limit of 2 s"):
        strict.process(_user({"type": "audio", "audio": (np.zeros(80000, np.float32), 16000)}))
    with pytest.raises(PromptError, match=r"video .*clip\.mkv.* lasts 5\.00 s, longer than the limit of 3 s"):
        strict.process(_user({"type": "video", "video": str(media_dir / "clip.mkv")}))
    with pytest.raises(PromptError, match="too short"):
        proc.process(_user({"type": "audio", "audio": (np.zeros(100, np.float32), 16000)}))
    with pytest.raises(PromptError, match=r"1 <\|IMAGE\|> placeholder\(s\) but multi_modal_data gives 2 image"):
        proc.process({"prompt": "<|vision_bos|><|IMAGE|><|vision_eos|>",
                      "multi_modal_data": {"image": [np.zeros((28, 28, 3), np.uint8)] * 2}})
    with pytest.raises(PromptError, match=r"must be written as <\|audio_bos\|><\|AUDIO\|><\|audio_eos\|>"):
        proc.process({"prompt": "listen <|AUDIO|>", "multi_modal_data": {"audio": (np.zeros(16000), 16000)}})
    with pytest.raises(PromptError, match="unknown multi_modal_data key"):
        proc.process({"prompt": "x", "multi_modal_data": {"pdf": 1}})
    with pytest.raises(PromptError, match="use_audio_in_video"):
        proc.process({"prompt": "x", "use_audio_in_video": "yes"})
    with pytest.raises(PromptError, match=r"messages\[0\]\.content\[1\]: cannot process this image: .*aspect ratio"):
        proc.process(_user({"type": "text", "text": "x"}, {"type": "image", "image": np.zeros((2, 600, 3), np.uint8)}))
    with pytest.raises(PromptError, match="same size"):
        proc.process(_user({"type": "video", "video": [np.zeros((28, 28, 3), np.uint8), np.zeros((30, 28, 3), np.uint8)]}))
