"""Stage-input functions of Qwen2.5-Omni: thinker -> talker -> token2wav.

They run in the receiving stage's process (runtime/stage_loop.py) and follow transformers'
`Qwen2_5OmniForConditionalGeneration.generate` (vLLM-Omni's thinker2talker omits the
embedding term; transformers adds it, and we follow transformers):

talker prompt (P prompt tokens + 2):
    embeds = [hidden_L + embeds_0 of the prompt (media positions of embeds_0 zeroed),
              thinker_embed(voice bos) + codec_embed(pad),
              hidden_L + embeds_0 of generated token 1 + codec_embed(bos)]
    ids    = [codec_mask] * P + [codec_pad, codec_bos]
each talker decode step adds the next "reply part" row to its codec embedding:
    reply = [hidden_L + embeds_0 of generated tokens 2..N-1, embed(tts_text_end), embed(tts_text_pad)]
with tts_text_pad repeated once the reply is used up. hidden_L is the thinker's last
hidden state (after the final norm), embeds_0 its input embeddings (layer 0).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..handoff import UpstreamOutputs, assemble_hidden, media_positions, require_thinker_layers
from ...checkpoint import eos_token_ids, parse_stage_config, read_config
from ...engine.protocol import AddRequest, StageInputs
from ...inputs.rope_index import RopeIndexConfig, get_rope_index
from .specs import STAGES
from .talker import TalkerConfig
from .voices import Voices


@dataclasses.dataclass
class Qwen2_5OmniHandoff:
    """Everything thinker2talker needs that is fixed per checkpoint."""

    voices: Voices
    talker: TalkerConfig
    rope: RopeIndexConfig
    media_token_ids: tuple[int, ...]
    thinker_eos: tuple[int, ...]
    hidden_layers: tuple[int, int]  # (0, num thinker layers): embeddings and final hidden state
    codebook_size: int | None = None  # codes the vocoder embeds (DiT num_embeds); None: no limit

    def thinker2talker(self, first: AddRequest, generated: list[int], hidden: dict, params, voice: str | None,
                       request_id: str) -> AddRequest:
        """The talker request built from the thinker's prompt, output tokens and hidden states."""
        v = self.voices.get(voice)
        prompt = np.asarray(first.prompt_token_ids, np.int64)
        p = len(prompt)
        lo, hi = self.hidden_layers
        embeds = assemble_hidden(hidden[lo])
        states = assemble_hidden(hidden[hi])
        n_fed = p + max(len(generated) - 1, 0)  # the last generated token is never fed back
        if len(embeds) < n_fed or len(states) < n_fed:
            raise ValueError(f"thinker returned hidden states for {min(len(embeds), len(states))} of {n_fed} tokens")
        embeds, states = embeds[:n_fed].copy(), states[:n_fed]
        embeds[:p][np.isin(prompt, self.media_token_ids)] = 0.0
        both = states + embeds
        prompt_part, reply = both[:p], both[p:]
        eos_row, pad_row = self.voices.row("text_eos_embed"), self.voices.row("text_pad_embed")
        if len(reply) == 0:
            # The thinker produced one token: transformers has no reply row to start with.
            reply = eos_row[None]
        first_reply = reply[0]
        tail = np.concatenate([reply[1:], eos_row[None], pad_row[None]])
        # transformers rewrites the tail so tts_text_end follows the first thinker eos.
        gen = np.asarray(generated)
        is_eos = np.isin(gen, self.thinker_eos)
        first_eos = int(np.argmax(is_eos)) if is_eos.any() else len(gen)
        first_eos = min(max(first_eos, 1), max(len(gen) - 1, 1))
        pos = np.arange(len(tail))
        tail = np.where((pos >= first_eos)[:, None], pad_row[None], tail)
        tail = np.where((pos == first_eos - 1)[:, None], eos_row[None], tail)

        overlay = np.concatenate([
            prompt_part,
            (v.bos_embed + self.voices.row("codec_pad_embed"))[None],
            (first_reply + self.voices.row("codec_bos_embed"))[None]]).astype(np.float32)
        ids = np.concatenate([np.full(p, self.talker.codec_mask), [self.talker.codec_pad, self.talker.codec_bos]])
        text_ids = np.concatenate([prompt, [v.bos_token, generated[0] if generated else v.bos_token]])
        positions, delta = self._positions(text_ids, first)
        inputs = StageInputs(mrope_positions=positions, mrope_delta=delta, overlay_rows=overlay,
                             overlay_index=np.arange(p + 2, dtype=np.int32), extra_embeds=tail.astype(np.float32),
                             extra_embeds_pad=pad_row.astype(np.float32))
        suppress = set(params.suppress_token_ids) | {self.talker.codec_bos}
        if self.codebook_size is not None:
            # Ids past the vocoder's codebook (other than the end tokens) would fail in
            # token2wav (transformers' too); a trained talker never picks them.
            suppress |= set(range(self.codebook_size, self.talker.text.vocab_size)) - set(self.talker.eos_token_ids)
        suppress = sorted(suppress)
        return AddRequest(request_id=request_id, prompt_token_ids=ids.astype(np.int32),
                          sampling_params=params.updated(suppress_token_ids=suppress), inputs=inputs,
                          arrival_time=first.arrival_time)

    def check_pipeline(self, pipeline) -> None:
        """ConfigError unless the pipeline's thinker returns the hidden layers the talker reads."""
        require_thinker_layers(pipeline, set(self.hidden_layers),
                               "the thinker's embeddings and last layer feed the talker")

    def stage_input(self, kind: str, control: AddRequest, upstream: UpstreamOutputs) -> AddRequest:
        """The request of a `kind` stage ("talker", "token2wav") from the stage before it."""
        if kind == "talker":
            return self.thinker2talker(control, upstream.token_ids, upstream.hidden, control.sampling_params,
                                       control.voice, control.request_id)
        if kind == "token2wav":
            return self.talker2token2wav(control, upstream.token_ids, control.sampling_params, control.voice,
                                         control.request_id)
        raise ValueError(f"Qwen2.5-Omni has no stage {kind!r} that takes another stage's output")

    def _positions(self, text_ids: np.ndarray, first: AddRequest):
        """The talker's M-RoPE positions: the thinker prompt's, continued by two text tokens."""
        return media_positions(text_ids, first.multi_modal, get_rope_index, config=self.rope)

    def talker2token2wav(self, first: AddRequest, codes: list[int], params, voice: str | None,
                         request_id: str) -> AddRequest:
        """The vocoder request: the codec tokens up to the first talker eos, and the voice."""
        codes = np.asarray(codes, np.int64)
        stop = np.isin(codes, self.talker.eos_token_ids)
        if stop.any():
            codes = codes[:int(np.argmax(stop))]
        if len(codes) == 0:
            raise ValueError("the talker produced no codec tokens before its end token")
        return AddRequest(request_id=request_id, prompt_token_ids=codes.astype(np.int32), sampling_params=params,
                          arrival_time=first.arrival_time, voice=self.voices.get(voice).name)


def load_handoff(ckpt_dir: str) -> Qwen2_5OmniHandoff:
    """The stage-input functions of a converted Qwen2.5-Omni checkpoint."""
    hf = read_config(ckpt_dir)["hf_config"]
    thinker = parse_stage_config(ckpt_dir, STAGES["thinker"], hf)
    return Qwen2_5OmniHandoff(
        Voices.load(ckpt_dir), parse_stage_config(ckpt_dir, STAGES["talker"], hf), RopeIndexConfig.from_hf(hf),
        thinker.media_token_ids, eos_token_ids(ckpt_dir), (0, thinker.text.num_layers),
        codebook_size=hf.get("token2wav_config", {}).get("dit_config", {}).get("num_embeds"))
