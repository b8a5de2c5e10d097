"""Stage-input functions of Qwen3-Omni: thinker -> talker -> code2wav.

They run in the receiving stage's process (runtime/stage_loop.py) and follow transformers'
`Qwen3OmniMoeForConditionalGeneration.generate`. The talker prompt is built from the
thinker's layer-0 embeddings (E) and its `accept_hidden_layer` states (S):

    user turns (every token whose turn starts "<|im_start|>user"; the system turn is dropped):
        media token -> hidden_projection(S), other token -> text_projection(E)
    assistant turn (9 rows; a = its "<|im_start|>", generated tokens follow the prompt):
        text_projection(E[a..a+2])                                   "<|im_start|>assistant\\n"
        text_projection(tts_pad) + codec(nothink | think_bos | think_eos | speaker)
        text_projection(tts_bos) + codec(pad)
        text_projection(E[a+3]) + codec(bos)                         the first reply token
    trailing text, one row per talker step: text_projection(E[a+4..]) then tts_eos, then
    tts_pad once used up.

The projections are talker weights, so the rows travel in the thinker's space with a
projection index per row (`StageInputs.overlay_proj`) and the talker stage projects them
on its device when the request arrives (stages.TalkerInputProjector). The talker's own
prompt ids are all `codec_pad`: transformers' talker sees no prompt ids (its repetition
penalty covers generated codes only), and codec_pad is among the suppressed ids, so
penalising it changes nothing.

talker -> code2wav: every talker token but the last (transformers never feeds the last
sampled token back, so it has no residual codes) with its residual codes, as frames of
`num_code_groups` codes, flattened frame-major.
"""

from __future__ import annotations

import dataclasses
import os

import msgspec.structs
import numpy as np
import safetensors.numpy

from ..handoff import UpstreamOutputs, media_positions, reply_rows, require_thinker_layers
from ...checkpoint import CONFIG_FILE, eos_token_ids, parse_stage_config, read_config
from ...errors import require
from ...engine.protocol import AddRequest, StageInputs
from ...inputs.rope_index import RopeIndexConfig
from .rope_index import get_rope_index_qwen3
from .specs import STAGES, TTS_ROWS_FILE
from .talker import TalkerConfig

_TEXT, _HIDDEN = 0, 1  # overlay_proj values: the talker's text_projection / hidden_projection


@dataclasses.dataclass(frozen=True)
class Speaker:
    name: str
    codec_id: int


class Speakers:
    """The checkpoint's voices (talker `speaker_id`), as the API asks for them."""

    def __init__(self, talker: TalkerConfig):
        self._ids = dict(talker.speaker_ids)
        self.names = sorted(self._ids)

    @property
    def default(self) -> str:
        return "ethan" if "ethan" in self._ids else self.names[0]  # transformers' default speaker

    def get(self, name: str | None) -> Speaker:
        """The named voice (case-insensitive; default "ethan"); an unknown one lists the others."""
        key = (name or self.default).lower()
        if key not in self._ids:
            raise ValueError(f"unknown voice {name!r}; available voices: {', '.join(self.names)}")
        return Speaker(key, self._ids[key])


@dataclasses.dataclass
class Qwen3OmniHandoff:
    """Everything the stage-input functions need that is fixed per checkpoint."""

    talker: TalkerConfig
    rope: RopeIndexConfig
    audio_n_window: int
    tts_rows: dict[str, np.ndarray]        # thinker embeddings of tts_bos / tts_eos / tts_pad
    im_start_id: int
    user_id: int
    assistant_id: int
    tts_pad_id: int
    media_token_ids: tuple[int, ...]
    thinker_eos: tuple[int, ...]

    @property
    def hidden_layers(self) -> tuple[int, int]:
        return 0, self.talker.accept_hidden_layer

    @property
    def voices(self) -> Speakers:
        return Speakers(self.talker)

    def check_pipeline(self, pipeline) -> None:
        """ConfigError unless the pipeline's thinker returns the hidden layers the talker reads."""
        require_thinker_layers(pipeline, set(self.hidden_layers),
                               "the thinker's embeddings and accept_hidden_layer feed the talker")

    def check_prompt(self, prompt_token_ids) -> None:
        """ValueError unless the talker can be built on this thinker prompt: it reads the chat turns
        off the token ids (a `prompt_embeds` prompt needs its real "prompt_token_ids" for speech)."""
        try:
            self._assistant_start(np.asarray(prompt_token_ids))
        except ValueError as e:
            raise ValueError(f"{e}: Qwen3-Omni speech needs a chat prompt (with prompt_embeds, give its "
                             f"prompt_token_ids too)") from None

    def stage_input(self, kind: str, control: AddRequest, upstream: UpstreamOutputs) -> AddRequest | None:
        """The request of a `kind` stage ("talker", "code2wav") from the stage before it, with
        what is final so far (None: not enough yet; see models/handoff.py)."""
        if kind == "talker":
            return self.talker_request(control, upstream)
        if kind == "code2wav":
            codes, complete = self.codec_frames(upstream, 0)
            if not complete and len(codes) == 0:
                return None
            if complete and len(codes) == 0:
                raise ValueError("the talker produced no codec frames before its end token")
            return AddRequest(request_id=control.request_id, prompt_token_ids=codes,
                              sampling_params=control.sampling_params, arrival_time=control.arrival_time)
        raise ValueError(f"Qwen3-Omni has no stage {kind!r} that takes another stage's output")

    def more_input(self, kind: str, control: AddRequest, upstream: UpstreamOutputs, have: int):
        """(rows or codec tokens after the first `have`, complete) of a started streamed request."""
        if kind == "talker":
            return self.reply_tail(control, upstream, have)
        if kind == "code2wav":
            return self.codec_frames(upstream, have)
        raise ValueError(f"Qwen3-Omni has no stage {kind!r} that takes another stage's output")

    def thinker2talker(self, first: AddRequest, generated: list[int], hidden: dict, params, voice: str | None,
                       request_id: str) -> AddRequest:
        """The talker request from a finished thinker request's tokens and hidden states
        (layer -> [(position, rows)] pieces, as the engine returns them)."""
        control = msgspec.structs.replace(first, sampling_params=params, voice=voice, request_id=request_id)
        return self.talker_request(control, UpstreamOutputs.complete(generated, hidden))

    def talker_request(self, control: AddRequest, up: UpstreamOutputs) -> AddRequest | None:
        """The talker request with the reply rows final so far; None until the thinker has
        written its first token (the assistant turn's last prompt row is the first reply
        token's embedding, sent with it)."""
        t = self.talker
        gen = np.asarray(up.token_ids, np.int64)
        eos = np.flatnonzero(np.isin(gen, self.thinker_eos))
        if len(gen) < 1 and not up.finished and not eos.size:
            return None
        speaker = Speakers(t).get(control.voice)
        prompt = np.asarray(control.prompt_token_ids, np.int64)
        p = len(prompt)
        # The turn of each prompt token: the token after the closest <|im_start|> before it.
        pos = np.arange(p)
        last_start = np.maximum.accumulate(np.where(prompt == self.im_start_id, pos, -1)).clip(min=0)
        user = prompt[np.minimum(last_start + 1, p - 1)] == self.user_id
        a = self._assistant_start(prompt)
        spoken = int(eos[0]) + 1 if eos.size else len(gen)  # nothing after the first eos is spoken
        # The last token is never fed back; a thinker still running has not written it yet.
        if p + spoken - (1 if up.finished or eos.size else 0) < a + 4:
            raise ValueError("the thinker's reply is empty: there is no text to speak")
        lo, hi = self.hidden_layers
        embeds = up.hidden[lo].get(slice(0, a + 4))

        user_idx = np.flatnonzero(user)
        media = np.isin(prompt[user_idx], self.media_token_ids)
        pad, bos = self.tts_rows["tts_pad"], self.tts_rows["tts_bos"]
        user_rows = np.where(media[:, None], up.hidden[hi].get(user_idx), embeds[user_idx])
        assistant_rows = np.concatenate([embeds[a:a + 3], np.repeat(pad[None], 4, 0), bos[None], embeds[a + 3:a + 4]])
        rows = np.concatenate([user_rows, assistant_rows]).astype(np.float32)
        proj = np.concatenate([np.where(media, _HIDDEN, _TEXT), np.full(9, _TEXT)]).astype(np.int8)
        add = np.concatenate([np.full(len(user_idx) + 3, -1), [t.codec_nothink_id, t.codec_think_bos_id,
                              t.codec_think_eos_id, speaker.codec_id, t.codec_pad_id, t.codec_bos_id]])
        trailing, _ = self.reply_tail(control, up, 0)

        text_ids = np.concatenate([prompt[user_idx], np.full(9, self.tts_pad_id)])
        positions, delta = self._positions(text_ids, control)
        inputs = StageInputs(mrope_positions=positions, mrope_delta=delta, overlay_rows=rows,
                             overlay_index=np.arange(len(rows), dtype=np.int32), overlay_proj=proj,
                             overlay_add_ids=add.astype(np.int32), extra_embeds=trailing,
                             extra_embeds_pad=pad.astype(np.float32), extra_proj=_TEXT)
        params = control.sampling_params
        suppress = sorted(set(params.suppress_token_ids) | set(t.suppressed_token_ids))
        return AddRequest(request_id=control.request_id, prompt_token_ids=np.full(len(rows), t.codec_pad_id, np.int32),
                          sampling_params=params.updated(suppress_token_ids=suppress), inputs=inputs,
                          arrival_time=control.arrival_time)

    def reply_tail(self, control: AddRequest, up: UpstreamOutputs, have: int) -> tuple[np.ndarray, bool]:
        """The talker's per-step text rows (thinker embeddings of the reply, then tts_eos) from
        row `have` on that are final, and whether they are complete (`handoff.reply_rows`)."""
        # The rows are the thinker's input embeddings of the reply, sent as each token is sampled.
        n_rows, complete = reply_rows(up.token_ids, up.finished, self.thinker_eos, rows_at_sampling=True)
        if complete:  # a one-token reply (just the eos) has no row at all, not even the first
            gen = np.asarray(up.token_ids)
            eos = np.flatnonzero(np.isin(gen, self.thinker_eos))
            n_rows = min(n_rows, (int(eos[0]) + 1 if eos.size else len(gen)) - 2)
        # Rows follow the assistant turn's first four tokens; a reply begun in the prompt
        # (text after "<|im_start|>assistant\n") is spoken too.
        first = self._assistant_start(np.asarray(control.prompt_token_ids)) + 4
        n_rows += len(control.prompt_token_ids) + 1 - first
        parts = []
        if have < n_rows:
            parts.append(up.hidden[self.hidden_layers[0]].get(first + np.arange(have, n_rows)))
        if complete and have <= n_rows:
            parts.append(self.tts_rows["tts_eos"][None])
        if not parts:
            return np.zeros((0, self.tts_rows["tts_eos"].shape[-1]), np.float32), complete
        return np.concatenate(parts).astype(np.float32), complete

    def _assistant_start(self, prompt: np.ndarray) -> int:
        """Position of the prompt's last "<|im_start|>assistant"."""
        starts = np.flatnonzero((prompt[:-1] == self.im_start_id) & (prompt[1:] == self.assistant_id))
        if starts.size == 0:
            raise ValueError("the prompt has no assistant turn for the talker to speak")
        return int(starts[-1])

    def _positions(self, text_ids: np.ndarray, first: AddRequest):
        """The talker's M-RoPE positions over its own prompt ids (None: 0..L-1 on all rows)."""
        return media_positions(text_ids, first.multi_modal, get_rope_index_qwen3, config=self.rope, n_window=self.audio_n_window)

    def codec_frames(self, up: UpstreamOutputs, have: int) -> tuple[np.ndarray, bool]:
        """The vocoder's codes after the first `have` (frames of all code groups, flattened
        frame-major), and whether the talker finished. Every talker token but the last is a
        frame: transformers never feeds the last sampled token back. A talker output that does
        not finish the request says its token is not the last, so while the talker runs each
        token is a frame as soon as it (and its residual codes) arrive."""
        q = self.talker.num_code_groups
        frames = min(len(up.token_ids) - (1 if up.finished else 0), len(up.codes))
        done = have // q
        if frames <= done:
            return np.zeros(0, np.int32), up.finished
        tokens = np.asarray(up.token_ids[done:frames], np.int64)
        codes = np.concatenate([tokens[:, None], up.codes.get(slice(done, frames))], axis=1)
        return codes.reshape(-1).astype(np.int32), up.finished


def load_handoff(ckpt_dir: str) -> Qwen3OmniHandoff:
    """The handoff of a converted Qwen3-Omni checkpoint (needs its tts_rows side file)."""
    hf = read_config(ckpt_dir)["hf_config"]
    path = os.path.join(ckpt_dir, TTS_ROWS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{ckpt_dir} has no {TTS_ROWS_FILE}: reconvert the checkpoint for speech output")
    thinker = hf["thinker_config"]
    where = f"{os.path.join(ckpt_dir, CONFIG_FILE)} (hf_config)"
    thinker_cfg = parse_stage_config(ckpt_dir, STAGES["thinker"], hf)
    return Qwen3OmniHandoff(
        talker=parse_stage_config(ckpt_dir, STAGES["talker"], hf), rope=RopeIndexConfig.from_hf(thinker),
        audio_n_window=thinker_cfg.audio.n_window,
        tts_rows=safetensors.numpy.load_file(path), im_start_id=require(hf, "im_start_token_id", section=where),
        user_id=require(hf, "user_token_id", section=where), assistant_id=require(hf, "assistant_token_id", section=where),
        tts_pad_id=require(hf, "tts_pad_token_id", section=where),
        media_token_ids=(thinker_cfg.audio_token_id, thinker_cfg.image_token_id, thinker_cfg.video_token_id),
        thinker_eos=eos_token_ids(ckpt_dir))
