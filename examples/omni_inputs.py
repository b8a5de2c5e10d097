"""Images, audio and video in one chat message, all made in code (nothing is downloaded).

    python examples/omni_inputs.py                    # the built-in tiny random model
    python examples/omni_inputs.py --model ckpt/qwen2_5_omni_7b

Media parts of a chat message:
  {"type": "image", "image": PIL image | HxWx3 uint8 array | path or URL}
  {"type": "audio", "audio": (waveform, sample_rate) | path or URL}
  {"type": "video", "video": list of HxWx3 frames | path or URL, "fps": frames per second,
   "audio": (waveform, sample_rate)}   # the soundtrack of a frame list
With "use_audio_in_video": True on the prompt, a video's soundtrack is fed to the audio
encoder and its tokens interleave with the frames in 2 s chunks (Qwen2.5-Omni's TMRoPE).
`--model tiny` (the default) is a random model: its answers are gibberish. The notebook
omni_inputs.ipynb walks through the same steps.
"""

from __future__ import annotations

import argparse

import numpy as np
from PIL import Image, ImageDraw

from omni_jax import OmniJax, SamplingParams

SAMPLE_RATE = 16000  # what the audio encoder expects; other rates are resampled


def small_pipeline(model: str):
    """For the tiny model, one shape bucket per step, with encoder buckets that fit these media
    (2 s of audio = 10 encoder chunks; a 4-frame video = 1152 patches); None otherwise."""
    if model != "tiny":
        return None
    from omni_jax.config import load_pipeline_config

    return load_pipeline_config("qwen2_5_omni_tiny").with_overrides(
        thinker=dict(max_num_seqs=1, token_buckets=[64], decode_buckets=[1],
                     audio_chunk_buckets=[16], vision_patch_buckets=[64, 1152]))


def make_image() -> Image.Image:
    """A 112x112 picture: a red circle, a blue square and a green triangle on white."""
    img = Image.new("RGB", (112, 112), "white")
    d = ImageDraw.Draw(img)
    d.ellipse((8, 8, 56, 56), fill="red")
    d.rectangle((60, 60, 104, 104), fill="blue")
    d.polygon([(8, 104), (32, 64), (56, 104)], fill="green")
    return img


def make_tone(seconds: float = 2.0, freq: float = 440.0) -> tuple[np.ndarray, int]:
    """A sine wave as (float32 waveform, sample rate)."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32), SAMPLE_RATE


def make_frames(n: int = 4, size: int = 64) -> list[np.ndarray]:
    """`n` RGB frames of a white square moving left to right on black."""
    frames = []
    for i in range(n):
        f = np.zeros((size, size, 3), np.uint8)
        x = i * (size - 16) // max(n - 1, 1)
        f[24:40, x:x + 16] = 255
        frames.append(f)
    return frames


def ask(model: str, max_tokens: int) -> list:
    image, tone, frames = make_image(), make_tone(), make_frames()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    everything = {"messages": [{"role": "user", "content": [
        {"type": "image", "image": image},
        {"type": "audio", "audio": tone},
        {"type": "video", "video": frames, "fps": 2.0},  # 4 frames at 2 fps: 2 s
        {"type": "text", "text": "What shapes are in the picture, what do you hear, and what moves in the video?"},
    ]}]}
    # The same frames with a soundtrack, heard by the audio encoder (use_audio_in_video).
    with_sound = {"messages": [{"role": "user", "content": [
        {"type": "video", "video": frames, "fps": 2.0, "audio": make_tone(2.0, 880.0)},
        {"type": "text", "text": "Describe what you see and hear."},
    ]}], "use_audio_in_video": True}
    with OmniJax(model=model, pipeline=small_pipeline(model)) as omni:
        for name, prompt in (("image + audio + video", everything), ("video with its audio", with_sound)):
            out = omni.generate(prompt, sampling_params=params)[0]
            if out.error:
                raise RuntimeError(out.error)
            print(f"{name}: {len(out.prompt_token_ids)} prompt tokens -> {out.text!r} (ttft {1e3 * out.metrics.ttft:.0f} ms)")
    return [everything, with_sound]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny",
                   help="'tiny' (the built-in random model) or the path of a checkpoint converted with "
                        "`omni-jax convert`")
    p.add_argument("--max-tokens", type=int, default=12)
    args = p.parse_args(argv)
    ask(args.model, args.max_tokens)


if __name__ == "__main__":
    main()
