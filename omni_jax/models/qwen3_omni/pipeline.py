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

import numpy as np
import safetensors.numpy

from ..handoff import UpstreamOutputs, assemble_hidden, media_positions, require_thinker_layers
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

    def stage_input(self, kind: str, control: AddRequest, upstream: UpstreamOutputs) -> AddRequest:
        """The request of a `kind` stage ("talker", "code2wav") from the stage before it."""
        if kind == "talker":
            return self.thinker2talker(control, upstream.token_ids, upstream.hidden, control.sampling_params,
                                       control.voice, control.request_id)
        if kind == "code2wav":
            return self.talker2code2wav(control, upstream, control.sampling_params, control.request_id)
        raise ValueError(f"Qwen3-Omni has no stage {kind!r} that takes another stage's output")

    def thinker2talker(self, first: AddRequest, generated: list[int], hidden: dict, params, voice: str | None,
                       request_id: str) -> AddRequest:
        """The talker request built from the thinker's prompt, reply and hidden states."""
        t = self.talker
        speaker = Speakers(t).get(voice)
        prompt = np.asarray(first.prompt_token_ids, np.int64)
        p = len(prompt)
        gen = np.asarray(generated, np.int64)
        eos = np.flatnonzero(np.isin(gen, self.thinker_eos))
        if eos.size:
            gen = gen[:eos[0] + 1]
        n_fed = p + len(gen) - 1  # the last generated token is never fed back
        lo, hi = self.hidden_layers
        embeds, states = assemble_hidden(hidden[lo]), assemble_hidden(hidden[hi])
        if min(len(embeds), len(states)) < n_fed:
            raise ValueError(f"thinker returned hidden states for {min(len(embeds), len(states))} of {n_fed} tokens")
        embeds, states = embeds[:n_fed], states[:n_fed]

        # The turn of each prompt token: the token after the closest <|im_start|> before it.
        pos = np.arange(p)
        last_start = np.maximum.accumulate(np.where(prompt == self.im_start_id, pos, -1)).clip(min=0)
        user = prompt[np.minimum(last_start + 1, p - 1)] == self.user_id
        starts = np.flatnonzero((prompt[:-1] == self.im_start_id) & (prompt[1:] == self.assistant_id))
        if starts.size == 0:
            raise ValueError("the prompt has no assistant turn for the talker to speak")
        a = int(starts[-1])
        if n_fed < a + 4:
            raise ValueError("the thinker's reply is empty: there is no text to speak")

        user_idx = np.flatnonzero(user)
        media = np.isin(prompt[user_idx], self.media_token_ids)
        pad, bos, eos_row = self.tts_rows["tts_pad"], self.tts_rows["tts_bos"], self.tts_rows["tts_eos"]
        user_rows = np.where(media[:, None], states[user_idx], embeds[user_idx])
        assistant_rows = np.concatenate([embeds[a:a + 3], np.repeat(pad[None], 4, 0), bos[None], embeds[a + 3:a + 4]])
        rows = np.concatenate([user_rows, assistant_rows]).astype(np.float32)
        proj = np.concatenate([np.where(media, _HIDDEN, _TEXT), np.full(9, _TEXT)]).astype(np.int8)
        add = np.concatenate([np.full(len(user_idx) + 3, -1), [t.codec_nothink_id, t.codec_think_bos_id,
                              t.codec_think_eos_id, speaker.codec_id, t.codec_pad_id, t.codec_bos_id]])
        trailing = np.concatenate([embeds[a + 4:], eos_row[None]]).astype(np.float32)

        text_ids = np.concatenate([prompt[user_idx], np.full(9, self.tts_pad_id)])
        positions, delta = self._positions(text_ids, first)
        inputs = StageInputs(mrope_positions=positions, mrope_delta=delta, overlay_rows=rows,
                             overlay_index=np.arange(len(rows), dtype=np.int32), overlay_proj=proj,
                             overlay_add_ids=add.astype(np.int32), extra_embeds=trailing,
                             extra_embeds_pad=pad.astype(np.float32), extra_proj=_TEXT)
        suppress = sorted(set(params.suppress_token_ids) | set(t.suppressed_token_ids))
        return AddRequest(request_id=request_id, prompt_token_ids=np.full(len(rows), t.codec_pad_id, np.int32),
                          sampling_params=params.updated(suppress_token_ids=suppress), inputs=inputs,
                          arrival_time=first.arrival_time)

    def _positions(self, text_ids: np.ndarray, first: AddRequest):
        """The talker's M-RoPE positions over its own prompt ids (None: 0..L-1 on all rows)."""
        return media_positions(text_ids, first.multi_modal, get_rope_index_qwen3, config=self.rope, n_window=self.audio_n_window)

    def talker2code2wav(self, first: AddRequest, acc: UpstreamOutputs, params, request_id: str) -> AddRequest:
        """The vocoder request: frames of all code groups, flattened frame-major."""
        tokens = np.asarray(acc.token_ids, np.int64)
        frames = len(tokens) - 1
        if frames < 1:
            raise ValueError("the talker produced no codec frames before its end token")
        residual = np.concatenate(acc.codes)[:frames]
        codes = np.concatenate([tokens[:frames, None], residual], axis=1)
        return AddRequest(request_id=request_id, prompt_token_ids=codes.reshape(-1).astype(np.int32),
                          sampling_params=params, arrival_time=first.arrival_time)


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
