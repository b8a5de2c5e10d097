"""Turn a user prompt into what the first stage needs, in the caller's process.

Accepted prompt forms (as vLLM):
* a plain string: the raw prompt, tokenized as is (no chat template);
* {"prompt_token_ids": [...]}: already tokenized;
* {"messages": [...]}: OpenAI-style chat messages, rendered with the checkpoint's chat
  template. Content is a string or a list of parts: {"type": "text", "text"},
  {"type": "image", "image": path|PIL|array} (or OpenAI {"type": "image_url", "image_url":
  {"url": path|file://|data:}}), {"type": "audio", "audio": path|(waveform, sample_rate)}
  (or {"type": "input_audio", "input_audio": {"data": base64, "format"}}, {"type":
  "audio_url", ...}), {"type": "video", "video": path|list of frames, "fps"?, "audio"?}
  (or {"type": "video_url", ...});
* {"prompt": str} or {"prompt_token_ids": [...]} with "multi_modal_data": {"image": ...,
  "audio": ..., "video": ...} (one item or a list each) where the prompt already holds one
  placeholder triple per item (the family's, e.g. Qwen2.5-Omni's
  `<|vision_bos|><|IMAGE|><|vision_eos|>`: see models/<family>/processor.py), or a ready
  `MultiModalPayload` (passed on untouched: the prompt must then hold the expanded placeholders
  already).
* with "messages", "tools": OpenAI's function tools, which the chat template writes into the
  prompt (Qwen's format: inputs/chat_template.py); an assistant message may then carry
  "tool_calls" (its "content" may be left out) and "tool" messages the calls' results;
  an assistant message's "reasoning_content" (a reasoning model's thinking) is written back as
  Qwen3's templates do (inputs/chat_template.py);
* with "messages", "chat_template_kwargs" (vLLM's): more variables for the chat template, e.g.
  {"add_vision_id": True} for "Picture 1: " labels, or what a checkpoint's own template reads
  (JSON values; not the names the template's own arguments have);
* with "messages", "continue_final_message": True (vLLM's): the last message, an assistant's
  text, is not closed: the reply continues it (its special-token strings stay text; a plain tag
  such as Qwen's `<tool_call>` is the token it is).
* {"prompt_embeds": array [T, H]} (numpy or JAX, any real dtype, cast to float32; H the
  thinker's hidden size), optionally with "prompt_token_ids" of the same length: the thinker
  takes these rows instead of token embeddings. The ids serve penalties, the talker's prompt
  structure and `OmniRequestOutput.prompt_token_ids`; without them every position gets
  `PROMPT_EMBEDS_PLACEHOLDER_ID`. No media with embeddings.
A dict prompt may also carry "use_audio_in_video" (or "mm_processor_kwargs":
{"use_audio_in_video": ...}) to override the processor's default.

Media are loaded (inputs/media.py) and turned into encoder inputs with transformers' own
parts, configured as the checkpoint's `preprocessor_config.json`: `WhisperFeatureExtractor`
(128-bin log-mel at 16 kHz, one [128, frames] array per audio) and `Qwen2VLImageProcessorPil`
(patches [N, 1176] + grids; video frames go through the same resize and normalisation and are
grouped in temporal pairs like the Qwen2-VL video processor). Each placeholder is then
expanded to as many tokens as its encoder produces, as transformers' processors do (with
`use_audio_in_video`, a video's frames and audio track come together, laid out the family's
way). Every problem raises `PromptError` naming it; the prompt's parts are read by
`prompt_parts.py`.

`InputProcessor` holds what the families share; what a family does its own way (defaults,
placeholders, audio token counts and padding, the audio-in-video layout, a speech system prompt)
is set by its subclass's class attributes and hook methods (`models/<family>/processor.py`).
`models.registry.prompt_processor(ckpt_dir)` picks the class from the checkpoint's family.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from ..engine.lru_cache import LRUCache
from ..engine.protocol import MultiModalPayload, audio_digest, image_digest
from ..errors import MediaError, PromptError, PromptTooLongError
from . import cancel, chat_messages, prompt_parts
from .chat_text import ChatText
from .media import MediaLimits, VideoClip, load_audio, load_image, load_video, source_key
from .rope_index import RopeIndexConfig
from .token_floor import TokenFloor

__all__ = [
    "InputProcessor",
    "PROMPT_EMBEDS_PLACEHOLDER_ID",
    "ProcessedPrompt",
    "PromptError",
]


# The processed media of recent prompts: 70 camera stills of 448 x 336 (3.6 MB of patches each),
# or about half an hour of audio (its 16 kHz samples and log-mel features).
MEDIA_CACHE_BYTES = 256 << 20


@dataclasses.dataclass
class ProcessedPrompt:
    """Token ids (int32), the encoder inputs and the prompt embeddings (float32 [T, H]) of one prompt."""

    prompt_token_ids: np.ndarray
    multi_modal: Any = None
    prompt_embeds: np.ndarray | None = None


# The token id of every position of a `prompt_embeds` prompt given without token ids. Id 0
# ("!" in Qwen's BPE) is a regular token in every Qwen vocabulary: never an end, media
# placeholder or chat-structure id, so no stage gives such a position a special meaning. A
# repetition / presence penalty does count it as a prompt token; give the real
# "prompt_token_ids" when that matters.
PROMPT_EMBEDS_PLACEHOLDER_ID = 0


def _size_range(cfg: dict, lo_default: int, hi_default: int) -> tuple[int, int]:
    size = cfg.get("size") or {}
    lo = cfg.get("min_pixels", size.get("shortest_edge", size.get("min_pixels", lo_default)))
    hi = cfg.get("max_pixels", size.get("longest_edge", size.get("max_pixels", hi_default)))
    return int(lo), int(hi)


def _merged(defaults: dict, given: dict | None) -> dict:
    """`given` over `defaults`; a given `size` dict replaces the default pixel range."""
    out = dict(defaults)
    given = dict(given or {})
    if "size" in given:
        for k in ("min_pixels", "max_pixels"):
            if k not in given:
                out.pop(k, None)
    out.update(given)
    return out


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


class InputProcessor:
    """Prompt -> ProcessedPrompt for one checkpoint: tokenizer, chat template and media processors.

    tokenizer: a transformers tokenizer (None: only pre-tokenized prompts). vocab_size: ids must be
    below it. preprocessor_config / video_preprocessor_config: the checkpoint's JSON files as dicts
    (default: the family's released values). token_config: placeholder ids
    and TMRoPE timing (default: the family's). use_audio_in_video: default for prompts that do not
    say. max_audio_seconds / max_video_seconds: longer media are refused. video_fps /
    video_min_frames / video_max_frames: frame sampling of video files (defaults from the video config).
    hidden_size: the thinker's, the width `prompt_embeds` must have (None: prompt_embeds refused).
    n_window: the thinker's audio encoder's `n_window` (its audio_config): an encoder chunk holds
    2 * n_window mel frames (None: the family's released value).
    media_limits: sample rates, pixel counts, frame rates and frame counts media may have, checked
    before decoding (None: `MediaLimits()`'s defaults).
    max_image_patches: images are resized to at most this many patches (the thinker's largest
    vision bucket: the vision encoder attends over a whole image, so one image is one encoder call),
    below the preprocessor config's max_pixels where that allows more (None: max_pixels alone).
    media_cache_bytes: host memory for the processed media of recent prompts, by their sources'
    content (0: none kept).
    """

    # A family's processor sets these (models/<family>/processor.py).
    DEFAULT_PREPROCESSOR_CONFIG: dict      # its released preprocessor_config.json (audio + image)
    DEFAULT_VIDEO_CONFIG: dict             # video pixel range, frame sampling and token budget
    DEFAULT_CHAT_TEMPLATE: str             # used when neither the checkpoint nor its tokenizer has one
    # Put first when the caller wants speech and the chat has no system message (None: nothing).
    SPEECH_SYSTEM_PROMPT: str | None = None
    # Placeholder token and the triple a prompt writes per media item (for error messages).
    PLACEHOLDER_TOKENS: dict
    PLACEHOLDER_TRIPLES: dict
    DEFAULT_N_WINDOW: int                  # the released audio encoder's n_window

    @classmethod
    def default_token_config(cls) -> RopeIndexConfig:
        """Placeholder ids and timing when the checkpoint gives none."""
        raise NotImplementedError

    def __init__(self, tokenizer, vocab_size: int, *, preprocessor_config: dict | None = None,
                 video_preprocessor_config: dict | None = None, token_config: RopeIndexConfig | None = None,
                 use_audio_in_video: bool = False, max_audio_seconds: float = 300.0,
                 max_video_seconds: float = 300.0, video_fps: float | None = None,
                 video_min_frames: int | None = None, video_max_frames: int | None = None,
                 chat_template: str | None = None, hidden_size: int | None = None,
                 media_limits: MediaLimits | None = None, n_window: int | None = None,
                 max_image_patches: int | None = None, media_cache_bytes: int = MEDIA_CACHE_BYTES):
        self.tokenizer = tokenizer
        self._chat_text = ChatText(tokenizer) if tokenizer is not None else None
        self._floor = TokenFloor(tokenizer) if tokenizer is not None else None
        self.media_limits = media_limits or MediaLimits()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tokens = token_config or self.default_token_config()
        self.use_audio_in_video = bool(use_audio_in_video)
        self.max_audio_seconds = max_audio_seconds
        self.max_video_seconds = max_video_seconds
        self.n_window = int(n_window if n_window is not None else self.DEFAULT_N_WINDOW)
        self.chat_template = chat_template
        self.max_image_patches = max_image_patches
        pre = _merged(self.DEFAULT_PREPROCESSOR_CONFIG, preprocessor_config)
        self.preprocessor_config = pre
        vid = _merged(self.DEFAULT_VIDEO_CONFIG, video_preprocessor_config)
        self.video_fps = float(video_fps if video_fps is not None else vid["fps"])
        self.video_min_frames = int(video_min_frames if video_min_frames is not None else vid["min_frames"])
        self.video_max_frames = int(video_max_frames if video_max_frames is not None else vid["max_frames"])
        self.video_pixels = _size_range(vid, self.DEFAULT_VIDEO_CONFIG["min_pixels"],
                                        self.DEFAULT_VIDEO_CONFIG["max_pixels"])
        self.max_video_tokens = int(vid["max_video_tokens"])
        self.sampling_rate = int(pre["sampling_rate"])
        self.patch_size = int(vid.get("patch_size", pre["patch_size"]))
        self.temporal_patch_size = int(vid.get("temporal_patch_size", pre["temporal_patch_size"]))
        self.merge_size = int(vid.get("merge_size", pre["merge_size"]))
        self._feature_extractor = None
        self._image_processor = None
        self._tools_template: str | None | object = _UNKNOWN  # the template that writes tools (found once)
        self.processed = LRUCache(media_cache_bytes)  # processed media by source (_loaded, _image, _audio)

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str, vocab_size: int | None = None, **options) -> "InputProcessor":
        """The processor of a converted checkpoint (or an HF directory): its tokenizer, config and
        preprocessor_config.json / video_preprocessor_config.json / chat_template.json when present.

        Each family's processor class is its `ModelFamily.prompt_processor` (see
        `models.registry.prompt_processor`, which picks it from the checkpoint).
        """
        cfg = _read_json(os.path.join(ckpt_dir, "omni_jax_config.json"))
        hf = cfg.get("hf_config", {}) if cfg is not None else (_read_json(os.path.join(ckpt_dir, "config.json")) or {})
        thinker = hf.get("thinker_config", hf)
        text = thinker.get("text_config") or {}
        if vocab_size is None:
            vocab_size = text.get("vocab_size") or thinker.get("vocab_size") or 2 ** 31 - 1
        options.setdefault("hidden_size", text.get("hidden_size") or thinker.get("hidden_size"))
        if (thinker.get("audio_config") or {}).get("n_window") is not None:
            options.setdefault("n_window", int(thinker["audio_config"]["n_window"]))
        tokenizer = None
        if any(os.path.isfile(os.path.join(ckpt_dir, f)) for f in ("tokenizer.json", "vocab.json")):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(ckpt_dir)
        template = (_read_json(os.path.join(ckpt_dir, "chat_template.json")) or {}).get("chat_template")
        options.setdefault("chat_template", template)
        options.setdefault("preprocessor_config", _read_json(os.path.join(ckpt_dir, "preprocessor_config.json")))
        options.setdefault("video_preprocessor_config",
                           _read_json(os.path.join(ckpt_dir, "video_preprocessor_config.json")))
        for k, v in cls._options_from_hf(hf).items():
            options.setdefault(k, v)
        return cls(tokenizer, int(vocab_size), **options)

    @classmethod
    def _options_from_hf(cls, hf: dict) -> dict:
        """Constructor options the family reads off the HF config (a whole config dict, maybe empty)."""
        raise NotImplementedError

    def audio_seconds(self, encoder_chunks: int) -> float:
        """Seconds of audio that many chunks of the audio encoder hold (a thinker's audio bucket)."""
        hop = int(self.preprocessor_config["hop_length"])
        return encoder_chunks * 2 * self.n_window * hop / self.sampling_rate

    # ------------------------------------------------------------------ media processors
    @property
    def feature_extractor(self):
        """transformers' WhisperFeatureExtractor with the checkpoint's audio settings."""
        if self._feature_extractor is None:
            from transformers import WhisperFeatureExtractor

            p = self.preprocessor_config
            self._feature_extractor = WhisperFeatureExtractor(
                feature_size=int(p["feature_size"]), sampling_rate=int(p["sampling_rate"]),
                hop_length=int(p["hop_length"]), chunk_length=int(p["chunk_length"]), n_fft=int(p["n_fft"]),
                padding_value=float(p["padding_value"]), dither=float(p["dither"]), return_attention_mask=True)
        return self._feature_extractor

    @property
    def image_processor(self):
        """transformers' Qwen2VLImageProcessorPil with the checkpoint's image settings."""
        if self._image_processor is None:
            from transformers import Qwen2VLImageProcessorPil

            p = self.preprocessor_config
            lo, hi = _size_range(p, 3136, 12845056)
            if self.max_image_patches is not None:
                hi = max(lo, min(hi, self.max_image_patches * int(p["patch_size"]) ** 2))
            self._image_processor = Qwen2VLImageProcessorPil(
                min_pixels=lo, max_pixels=hi, patch_size=int(p["patch_size"]),
                temporal_patch_size=int(p["temporal_patch_size"]), merge_size=int(p["merge_size"]),
                image_mean=list(p["image_mean"]), image_std=list(p["image_std"]))
        return self._image_processor

    def audio_features(self, wave: np.ndarray, pad_to: int | None = None) -> np.ndarray:
        """Log-mel features [feature_size, frames] of one 16 kHz mono waveform.

        Equal to the valid frames of the feature extractor's output for the waveform zero-padded
        to `pad_to` samples (default: `chunk_length` seconds, Qwen2.5-Omni's padding): padding
        only a little past the end gives the same frames (the normalisation's maximum sees the
        same zero-padding floor) at a fraction of the cost. The frame count is the extractor's
        mask: min(ceil(n / hop), pad_to // hop).
        """
        fe = self.feature_extractor
        n = int(wave.shape[0])
        hop = fe.hop_length
        if pad_to is None:
            pad_to = int(self.preprocessor_config["chunk_length"]) * fe.sampling_rate
        max_length = max(n, min(int(pad_to), -(-(n + 2 * fe.n_fft) // hop) * hop))
        out = fe(wave, sampling_rate=fe.sampling_rate, padding="max_length", max_length=max_length,
                 truncation=False, return_attention_mask=True, return_tensors="np")
        frames = int(out["attention_mask"][0].sum())
        return np.ascontiguousarray(out["input_features"][0][:, :frames], np.float32)

    def image_inputs(self, images: list) -> tuple[np.ndarray, np.ndarray]:
        """(pixel_values [patches, C*T*P*P] float32, image_grid_thw [N, 3] int64) of RGB PIL images."""
        out = self.image_processor(images=list(images), return_tensors="np")
        return np.asarray(out["pixel_values"], np.float32), np.asarray(out["image_grid_thw"], np.int64)

    def video_inputs(self, clip: VideoClip) -> tuple[np.ndarray, np.ndarray, float]:
        """(pixel_values_videos, grid_thw [3], seconds per temporal grid step) of one sampled video.

        Frames are resized (pixel range of the video config, per-frame cap from the total
        token budget), rescaled and normalised by the image processor, then grouped in
        `temporal_patch_size` consecutive frames per patch (the last frame repeated to fill the
        last group), in the layout of transformers' Qwen2-VL video processor.
        """
        from PIL import Image

        frames = clip.frames
        t = frames.shape[0]
        tps, ps = self.temporal_patch_size, self.patch_size
        factor = ps * self.merge_size
        lo, hi = self.video_pixels
        budget = int(self.max_video_tokens * factor * factor * 0.9)
        hi = max(min(hi, budget * tps // t), int(lo * 1.05))
        out = self.image_processor(images=[Image.fromarray(f) for f in frames],
                                   size={"shortest_edge": lo, "longest_edge": hi}, return_tensors="np")
        grid = np.asarray(out["image_grid_thw"])
        gh, gw = int(grid[0, 1]), int(grid[0, 2])
        c = frames.shape[-1]
        # Image patches repeat each frame over the temporal axis; keep one copy per frame.
        per_frame = np.asarray(out["pixel_values"], np.float32).reshape(t, gh * gw, c, tps, ps, ps)[:, :, :, 0]
        if t % tps:
            per_frame = np.concatenate([per_frame, np.repeat(per_frame[-1:], tps - t % tps, axis=0)])
        gt = per_frame.shape[0] // tps
        patches = per_frame.reshape(gt, tps, gh * gw, c, ps, ps).transpose(0, 2, 3, 1, 4, 5)
        return (np.ascontiguousarray(patches.reshape(gt * gh * gw, c * tps * ps * ps)),
                np.array([gt, gh, gw], np.int64), tps / clip.fps)

    # ------------------------------------------------------------------ text
    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise PromptError(f"{what} needs a tokenizer, and this checkpoint has none; "
                              f"pass {{'prompt_token_ids': [...]}} instead")
        return self.tokenizer

    def _encode(self, text: str) -> np.ndarray:
        tok = self._need_tokenizer("a text prompt")
        chat_messages.check_unicode(text)
        return np.asarray(tok(text, add_special_tokens=False)["input_ids"], np.int32)

    def _encode_chat(self, rendered: str) -> np.ndarray:
        """A rendered chat's ids; the user's text in it (hidden by `_normalize_messages`) stays text."""
        if self._chat_text is None or not self._chat_text.has_hidden(rendered):
            return self._encode(rendered)
        return self._chat_text.encode(rendered)

    def chat_token_ids(self, messages: list, speech_output: bool = False, assistant_prefix: str = "") -> np.ndarray:
        """Token ids of text-only chat messages with the assistant turn opened and begun with
        `assistant_prefix`; special-token strings typed in the messages or the prefix stay text."""
        begun = [*messages, {"role": "assistant", "content": assistant_prefix}]
        return self.process({"messages": begun, "continue_final_message": True}, speech_output).prompt_token_ids

    def _hide(self, text: str) -> str:
        return text if self._chat_text is None else self._chat_text.hide(text)

    def _normalize_messages(self, messages: Any, speech_output: bool, need_source: bool = True,
                            hide: bool = False) -> tuple[list, list[prompt_parts.MediaItem]]:
        """The messages as the template reads them and their media items (chat_messages.py), with
        the family's speech system prompt for a spoken reply. `hide`: special-token strings in
        roles, text, tool calls and reasoning become stand-ins (chat_text.py)."""
        canonical, items = chat_messages.canonical(messages, self._hide if hide else None, need_source)
        return self.speech_messages(canonical) if speech_output else canonical, items

    def speech_messages(self, messages: list) -> list:
        """Chat messages as a spoken reply's prompt has them: with the family's speech system prompt
        (if it has one) when they have no system message."""
        if self.SPEECH_SYSTEM_PROMPT and not any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
            # Qwen2.5-Omni's talker is trained to speak only under this system prompt.
            return [{"role": "system", "content": self.SPEECH_SYSTEM_PROMPT}, *messages]
        return messages

    def render_chat(self, messages: list, speech_output: bool = False) -> str:
        """The chat template applied to the messages (one placeholder triple per media part),
        with the assistant turn opened; `speech_output` adds the family's speech system prompt
        (if it has one) when there is no system message."""
        canonical, _ = self._normalize_messages(messages, speech_output, need_source=False)
        return self._render(canonical)

    def _render(self, canonical: list, tools: list | None = None, template: str | None = None,
                kwargs: dict | None = None) -> str:
        tok = self._need_tokenizer("a chat prompt")
        return tok.apply_chat_template(canonical, chat_template=template or self._template(), tools=tools,
                                       add_generation_prompt=True, tokenize=False, **(kwargs or {}))

    def _template(self) -> str:
        return self.chat_template or getattr(self.tokenizer, "chat_template", None) or self.DEFAULT_CHAT_TEMPLATE

    def _template_for_tools(self) -> str:
        """The template that writes a prompt's tools: the checkpoint's, or where it leaves tools out
        (Qwen2.5-Omni's released one does), the family's built-in one if it writes every probe
        conversation as the checkpoint's does (it is then that template with Qwen's tool turns);
        else PromptError (a model that is not told of its tools cannot call them)."""
        if self._tools_template is _UNKNOWN:
            own, probe = self._template(), [{"role": "user", "content": "x"}]
            self._tools_template = None
            if self._render(probe, [_PROBE_TOOL], own) != self._render(probe, None, own):
                self._tools_template = own
            elif all(self._render(c, None, own) == self._render(c, None, self.DEFAULT_CHAT_TEMPLATE)
                     for c in _PROBE_CHATS):
                self._tools_template = self.DEFAULT_CHAT_TEMPLATE
        if self._tools_template is None:
            raise PromptError("this checkpoint's chat template does not write tools into the prompt, so the model "
                              "cannot be told of them")
        return self._tools_template

    # ------------------------------------------------------------------ entry point
    def process(self, prompt: Any, speech_output: bool = False,
                max_prompt_len: int | None = None) -> ProcessedPrompt:
        """Validate, tokenize and expand one prompt (see module docstring).

        speech_output: the caller wants audio out; chat messages without a system message
        then get the family's speech system prompt, if any (raw prompts are left as given).
        max_prompt_len: longer prompts are refused here: a text as soon as it certainly has more
        tokens (without tokenizing it whole, see token_floor.py), token ids before any media is
        decoded and again once the media is expanded, `prompt_embeds` before they travel.
        """
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:
            return self._embeds_prompt(prompt, max_prompt_len)
        items: list[prompt_parts.MediaItem] | None = None
        mm = None
        use_aiv = self.use_audio_in_video
        by_kind = False
        if isinstance(prompt, str):
            self._check_fits([prompt], max_prompt_len)
            ids = self._encode(prompt)
        elif isinstance(prompt, dict):
            unknown = set(prompt) - prompt_parts.PROMPT_KEYS
            if unknown:
                raise PromptError(f"unknown prompt key(s) {sorted(unknown)}; use 'prompt', "
                                  f"'prompt_token_ids', 'messages', 'multi_modal_data' or 'use_audio_in_video'")
            given = [k for k in ("prompt", "prompt_token_ids", "messages") if k in prompt]
            if len(given) != 1:
                raise PromptError(f"a prompt dict needs exactly one of 'prompt', 'prompt_token_ids', "
                                  f"'messages'; got {given or 'none'}")
            use_aiv = prompt_parts.use_audio_in_video(prompt, use_aiv)
            for key in ("tools", "continue_final_message", "chat_template_kwargs"):
                if key in prompt and "messages" not in prompt:
                    raise PromptError(f"'{key}' goes with 'messages' (it is about the chat template)")
            if "messages" in prompt:
                if "multi_modal_data" in prompt:
                    raise PromptError("with 'messages', put the media in the message parts, not in 'multi_modal_data'")
                # checked first (linear, no tokenizer): message_texts writes their JSON
                tools = chat_messages.tools(prompt.get("tools"), self._hide)
                kwargs = chat_messages.template_kwargs(prompt.get("chat_template_kwargs"), self._hide)
                canonical, items = self._normalize_messages(prompt["messages"], speech_output, hide=True)
                self._check_fits(prompt_parts.message_texts(prompt["messages"], prompt.get("tools"),
                                                            prompt.get("chat_template_kwargs")), max_prompt_len)
                begun = ""
                if prompt.get("continue_final_message"):
                    last = canonical[-1]
                    if last["role"] != "assistant" or not isinstance(last["content"], str) or "tool_calls" in last:
                        raise PromptError("continue_final_message needs the last message to be an assistant's text")
                    canonical, begun = canonical[:-1], last["content"]
                template = self._template_for_tools() if tools is not None else None
                ids = self._encode_chat(self._render(canonical, tools, template, kwargs) + begun)
            elif "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise PromptError("'prompt' must be a string")
                self._check_fits([prompt["prompt"]], max_prompt_len)
                ids = self._encode(prompt["prompt"])
            else:
                ids = prompt_parts.token_ids(prompt["prompt_token_ids"])
            raw = prompt.get("multi_modal_data")
            if isinstance(raw, MultiModalPayload) or raw is None:
                mm = raw
            elif isinstance(raw, dict):
                items, by_kind = prompt_parts.media_items(raw), True
            else:
                raise PromptError(f"'multi_modal_data' must be a dict of 'image' / 'audio' / 'video' items or a "
                                  f"MultiModalPayload, got {type(raw).__name__}")
        else:
            raise PromptError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")
        if ids.size == 0:
            raise PromptError("empty prompt")
        if max_prompt_len is not None and ids.size > max_prompt_len:
            # Each media placeholder only grows: refused before any media is decoded.
            raise self._too_long(max_prompt_len, f"it has {ids.size} tokens")
        if items is not None:
            ids, mm = self._expand(ids, items, by_kind, use_aiv)
            if max_prompt_len is not None and ids.size > max_prompt_len:
                # Its media made it too long: refused as a prompt too long (a server's
                # context_length_exceeded, which a realtime session answers by dropping old turns).
                raise self._too_long(max_prompt_len, f"with its media it has {ids.size} tokens")
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bad.any():
            raise PromptError(f"token id {int(ids[bad][0])} is out of range [0, {self.vocab_size})")
        return ProcessedPrompt(ids, mm)

    @staticmethod
    def _too_long(limit: int, why: str) -> PromptTooLongError:
        return PromptTooLongError(f"the prompt is too long: {why}; a prompt may have at most {limit} tokens "
                                  f"(the first stage's max_model_len {limit + 1}, less one for the reply)")

    def _check_fits(self, texts, max_prompt_len: int | None) -> None:
        """PromptError if the texts cannot make at most max_prompt_len tokens (found in bounded time
        and memory, before the texts are rendered or tokenized whole: token_floor.py)."""
        if max_prompt_len is None or self._floor is None:
            return
        why = self._floor.check([t for t in texts if isinstance(t, str)], max_prompt_len, cancel.check)
        if why is not None:
            raise self._too_long(max_prompt_len, why)

    def _embeds_prompt(self, prompt: dict, max_prompt_len: int | None) -> ProcessedPrompt:
        """A `prompt_embeds` prompt: the rows checked and cast to float32, with their token ids."""
        other = sorted(set(prompt) - {"prompt_embeds", "prompt_token_ids"})
        if other:
            raise PromptError(f"'prompt_embeds' takes only 'prompt_token_ids' beside it, got {other}")
        if self.hidden_size is None:
            raise PromptError("this checkpoint does not say the thinker's hidden size; 'prompt_embeds' "
                              "cannot be checked")
        rows = prompt_parts.prompt_embeds(prompt["prompt_embeds"], int(self.hidden_size), max_prompt_len)
        if "prompt_token_ids" not in prompt:
            return ProcessedPrompt(np.full(len(rows), PROMPT_EMBEDS_PLACEHOLDER_ID, np.int32), prompt_embeds=rows)
        ids = prompt_parts.token_ids(prompt["prompt_token_ids"])
        if len(ids) != len(rows):
            raise PromptError(f"'prompt_token_ids' has {len(ids)} ids but 'prompt_embeds' has {len(rows)} rows; "
                              f"give one id per row")
        bad = ids >= self.vocab_size
        if bad.any():
            raise PromptError(f"token id {int(ids[bad][0])} is out of range [0, {self.vocab_size})")
        return ProcessedPrompt(ids, prompt_embeds=rows)

    # ------------------------------------------------------------------ placeholders
    def _expand(self, ids: np.ndarray, items: list[prompt_parts.MediaItem], by_kind: bool,
                use_audio_in_video: bool) -> tuple[np.ndarray, MultiModalPayload | None]:
        """Load the media, run the feature extractors and expand each placeholder token."""
        c = self.tokens
        kind_of = {c.image_token_id: "image", c.audio_token_id: "audio", c.video_token_id: "video"}
        where = np.flatnonzero(np.isin(ids, list(kind_of)))
        kinds = [kind_of[int(ids[p])] for p in where]
        if by_kind:
            # multi_modal_data: the i-th placeholder of a kind takes the i-th item of that kind.
            pools = {k: [it for it in items if it.kind == k] for k in ("image", "audio", "video")}
            for k, pool in pools.items():
                have = kinds.count(k)
                if have != len(pool):
                    tok = self.PLACEHOLDER_TOKENS[k]
                    raise PromptError(f"the prompt has {have} {tok} placeholder(s) but multi_modal_data gives "
                                      f"{len(pool)} {k} item(s); write one placeholder per item")
            ordered = [pools[k].pop(0) for k in kinds]
        else:
            if kinds != [it.kind for it in items]:
                raise PromptError(f"the rendered prompt has placeholders {kinds} but the messages hold media "
                                  f"{[it.kind for it in items]}; is a placeholder token written in the text?")
            ordered = items
        if not ordered:
            return ids, None
        self._check_brackets(ids, where, kinds)

        # Load the clips and videos first: the audio padding may depend on all the prompt's clips.
        keys = [source_key(item.src) if item.kind != "video" else None for item in ordered]
        loaded = [None if item.kind == "image" else self._loaded(item, key, use_audio_in_video)
                  for item, key in zip(ordered, keys)]
        waves = [x.audio if isinstance(x, VideoClip) else x for it, x in zip(ordered, loaded)
                 if it.kind == "audio" or (isinstance(x, VideoClip) and use_audio_in_video and x.audio is not None)]
        pad_to = self._audio_pad_length(waves)

        audio_feats, audio_digests = [], []
        image_pixels, image_grids, image_digests = [], [], []
        video_pixels, video_grids, video_spg = [], [], []
        pieces: list[np.ndarray] = []
        cursor = 0
        for pos, item, key, media in zip(where, ordered, keys, loaded):
            pieces.append(ids[cursor:pos])
            cursor = pos + 1
            if item.kind == "image":
                pix, grid, digest = self._image(item, key)
                image_pixels.append(pix)
                image_grids.append(grid)
                image_digests.append(digest)
                pieces.append(np.full(int(np.prod(grid)) // self.merge_size ** 2, c.image_token_id, np.int32))
            elif item.kind == "audio":
                feats, n, digest = self._audio(item, key, media, pad_to, "audio")
                audio_feats.append(feats)
                audio_digests.append(digest)
                pieces.append(np.full(n, c.audio_token_id, np.int32))
            else:
                pix, grid, spg = self._guarded(item, self.video_inputs, media)
                video_pixels.append(pix)
                video_grids.append(grid)
                video_spg.append(spg)
                if use_audio_in_video and media.audio is not None:
                    feats, n_audio, digest = self._audio(item, None, media.audio, pad_to, "the video's audio track")
                    audio_feats.append(feats)
                    audio_digests.append(digest)
                    pieces.append(self._video_with_audio(grid, spg, n_audio))
                else:
                    pieces.append(np.full(int(np.prod(grid)) // self.merge_size ** 2, c.video_token_id, np.int32))
        pieces.append(ids[cursor:])

        digests = {kind: d for kind, d in (("audio", audio_digests), ("image", image_digests)) if d}
        payload = MultiModalPayload(audio_features=audio_feats, use_audio_in_video=use_audio_in_video,
                                    digests=digests)
        if image_pixels:
            payload.pixel_values = np.concatenate(image_pixels)
            payload.image_grid_thw = np.stack(image_grids)
        if video_pixels:
            payload.pixel_values_videos = np.concatenate(video_pixels)
            payload.video_grid_thw = np.stack(video_grids)
            payload.video_second_per_grid = np.asarray(video_spg, np.float32)
        return np.concatenate(pieces).astype(np.int32), payload

    @staticmethod
    def _guarded(item: prompt_parts.MediaItem, fn, *args):
        """fn(*args), with any media / processing problem raised as a PromptError naming the item.
        Each such step is also where a cancelled prompt stops (inputs/cancel.py)."""
        cancel.check()
        try:
            return fn(*args)
        except (MediaError, PromptError) as e:
            raise PromptError(f"{item.where}: {e}") from None
        except ValueError as e:  # e.g. the image processor refusing an extreme aspect ratio
            raise PromptError(f"{item.where}: cannot process this {item.kind}: {e}") from None

    # A conversation sends its earlier media again each turn (OpenAI's chat API; the realtime API
    # renders its whole conversation): each item whose source carries its content (source_key)
    # is loaded and processed once, then read back from `self.processed`.
    def _loaded(self, item: prompt_parts.MediaItem, key: str | None, use_audio_in_video: bool):
        """The loaded media of an audio or video item (an audio clip's: held by its source's key)."""
        held = None if key is None else self.processed.get(("wave", key))
        if held is None:
            held = (_frozen(self._guarded(item, self._load, item, use_audio_in_video)),)
            if key is not None:
                self.processed.put(("wave", key), held)
        return held[0]

    def _image(self, item: prompt_parts.MediaItem, key: str | None) -> tuple[np.ndarray, np.ndarray, str]:
        """(patches, grid [3], digest) of an image item."""
        held = None if key is None else self.processed.get(("image", key))
        if held is None:
            pix, grid = self._guarded(item, self.image_inputs, [self._guarded(item, self._load, item, False)])
            held = (_frozen(pix), _frozen(grid[0]), image_digest(pix, grid[0]))
            if key is not None:
                self.processed.put(("image", key), held)
        return held

    def _audio(self, item: prompt_parts.MediaItem, key: str | None, wave: np.ndarray, pad_to: int,
               what: str) -> tuple[np.ndarray, int, str]:
        """(features, audio tokens, digest) of a clip padded to `pad_to` samples."""
        held = None if key is None else self.processed.get(("audio", key, pad_to))
        if held is None:
            feats = self._guarded(item, self.audio_features, wave, pad_to)
            n = self._guarded(item, self._audio_tokens, feats, wave, what)
            held = (_frozen(feats), n, audio_digest(feats))
            if key is not None:
                self.processed.put(("audio", key, pad_to), held)
        return held

    def _load(self, item: prompt_parts.MediaItem, use_audio_in_video: bool):
        """The loaded media of one item: an RGB PIL image, a waveform at the model's rate, or a VideoClip."""
        if item.kind == "image":
            return load_image(item.src, limits=self.media_limits)
        if item.kind == "audio":
            return load_audio(item.src, max_seconds=self.max_audio_seconds, target_rate=self.sampling_rate,
                              limits=self.media_limits)
        return load_video(item.src, fps=item.fps or self.video_fps, min_frames=self.video_min_frames,
                          max_frames=self.video_max_frames, temporal_patch_size=self.temporal_patch_size,
                          with_audio=use_audio_in_video, audio=item.audio, max_seconds=self.max_video_seconds,
                          target_rate=self.sampling_rate, limits=self.media_limits)

    # ------------------------------------------------------------------ family hooks
    def _audio_pad_length(self, waves: list[np.ndarray]) -> int:
        """Samples every clip of a prompt is zero-padded to before feature extraction."""
        raise NotImplementedError

    def _num_audio_tokens(self, frames: int) -> int:
        """Audio encoder output tokens of `frames` mel frames."""
        raise NotImplementedError

    def _audio_tokens(self, feats: np.ndarray, wave: np.ndarray, what: str) -> int:
        n = self._num_audio_tokens(int(feats.shape[1]))
        if n < 1:
            raise PromptError(f"{what} is too short: {wave.shape[0] / self.sampling_rate * 1000:.1f} ms "
                              f"gives no audio token")
        return n

    def _video_with_audio(self, grid: np.ndarray, spg: float, n_audio: int) -> np.ndarray:
        """The tokens replacing a video placeholder when its audio track comes along."""
        raise NotImplementedError

    def _check_brackets(self, ids: np.ndarray, where: np.ndarray, kinds: list[str]) -> None:
        """Each placeholder must sit between its start and end tokens (the encoders' layout relies on it)."""
        c = self.tokens
        pairs = {"image": (c.vision_start_token_id, c.vision_end_token_id),
                 "video": (c.vision_start_token_id, c.vision_end_token_id),
                 "audio": (c.audio_start_token_id, c.audio_end_token_id)}
        names = self.PLACEHOLDER_TRIPLES
        for pos, kind in zip(where, kinds):
            bos, eos = pairs[kind]
            if pos == 0 or pos + 1 >= len(ids) or ids[pos - 1] != bos or ids[pos + 1] != eos:
                raise PromptError(f"the {kind} placeholder at token {int(pos)} must be written as {names[kind]}")


# ---------------------------------------------------------------------- prompt parsing helpers

# A tool the template is asked to write once, to learn whether it writes tools at all; and the
# conversations two templates must write alike to stand for each other.
_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "", "parameters": {}}}
_PROBE_CHATS = (
    [{"role": "user", "content": "x"}],
    [{"role": "system", "content": "s"},
     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "audio"}, {"type": "video"}]},
     {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
)
_UNKNOWN = object()


def _frozen(value):
    """`value`, made read-only if an array: what the cache holds is shared by every prompt using it."""
    if isinstance(value, np.ndarray):
        value.flags.writeable = False
    return value

