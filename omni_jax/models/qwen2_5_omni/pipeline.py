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

A reply begun in the prompt (text after the last "<|im_start|>assistant\n", as the speech
endpoint writes the text to say) is spoken too: its tokens count as the first generated ones
(P is then the prompt up to them), which transformers, knowing no begun replies, cannot do.
"""

from __future__ import annotations

import dataclasses

import msgspec.structs
import numpy as np

from ..handoff import (UpstreamOutputs, assistant_turn_ids, media_positions, reply_rows, reply_start,
                       require_thinker_layers)
from ...checkpoint import eos_token_ids, parse_stage_config, read_config
from ...engine.protocol import AddRequest, StageInputs
from ...inputs.rope_index import RopeIndexConfig
from .rope_index import get_rope_index
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
    assistant_turn: tuple[int, ...] | None = None  # "<|im_start|>assistant\n" (None: no tokenizer)

    def thinker2talker(self, first: AddRequest, generated: list[int], hidden: dict, params, voice: str | None,
                       request_id: str) -> AddRequest:
        """The talker request from a finished thinker request's tokens and hidden states
        (layer -> [(position, rows)] pieces, as the engine returns them)."""
        control = msgspec.structs.replace(first, sampling_params=params, voice=voice, request_id=request_id)
        return self.talker_request(control, UpstreamOutputs.complete(generated, hidden))

    def talker_request(self, control: AddRequest, up: UpstreamOutputs) -> AddRequest | None:
        """The talker request with the reply rows final so far; None until the thinker has
        written two reply tokens (the first reply row is the second fed token's) or finished."""
        prompt = np.asarray(control.prompt_token_ids, np.int64)
        p = self._reply_start(prompt)
        reply = [*prompt[p:].tolist(), *up.token_ids]  # begun in the prompt, then generated
        if (len(reply) < 2 or not up.token_ids) and not up.finished:
            return None
        params = control.sampling_params
        v = self.voices.get(control.voice)
        prompt = prompt[:p]
        lo, hi = self.hidden_layers
        embeds, states = up.hidden[lo].get(slice(0, p)), up.hidden[hi].get(slice(0, p))
        embeds[np.isin(prompt, self.media_token_ids)] = 0.0
        # The thinker produced one token: transformers has no reply row to start with.
        first_reply = self._token_rows(up, [p])[0] if len(reply) > 1 else self.voices.row("text_eos_embed")
        overlay = np.concatenate([
            states + embeds,
            (v.bos_embed + self.voices.row("codec_pad_embed"))[None],
            (first_reply + self.voices.row("codec_bos_embed"))[None]]).astype(np.float32)
        ids = np.concatenate([np.full(p, self.talker.codec_mask), [self.talker.codec_pad, self.talker.codec_bos]])
        text_ids = np.concatenate([prompt, [v.bos_token, reply[0] if reply else v.bos_token]])
        positions, delta = self._positions(text_ids, control)
        tail, _ = self.reply_tail(control, up, 0)
        inputs = StageInputs(mrope_positions=positions, mrope_delta=delta, overlay_rows=overlay,
                             overlay_index=np.arange(p + 2, dtype=np.int32), extra_embeds=tail,
                             extra_embeds_pad=self.voices.row("text_pad_embed").astype(np.float32))
        suppress = set(params.suppress_token_ids) | {self.talker.codec_bos}
        if self.codebook_size is not None:
            # Ids past the vocoder's codebook (other than the end tokens) would fail in
            # token2wav (transformers' too); a trained talker never picks them.
            suppress |= set(range(self.codebook_size, self.talker.text.vocab_size)) - set(self.talker.eos_token_ids)
        suppress = sorted(suppress)
        return AddRequest(request_id=control.request_id, prompt_token_ids=ids.astype(np.int32),
                          sampling_params=params.updated(suppress_token_ids=suppress), inputs=inputs,
                          arrival_time=control.arrival_time)

    def _reply_start(self, prompt: np.ndarray) -> int:
        return reply_start(prompt, self.assistant_turn, self.media_token_ids)

    def _token_rows(self, up: UpstreamOutputs, positions) -> np.ndarray:
        """A generated token's talker row: the thinker's last hidden state plus its embedding."""
        lo, hi = self.hidden_layers
        return up.hidden[hi].get(positions) + up.hidden[lo].get(positions)

    def reply_tail(self, control: AddRequest, up: UpstreamOutputs, have: int) -> tuple[np.ndarray, bool]:
        """The talker's per-step reply rows from row `have` on that are final, and whether
        they are complete (transformers' rule, as `handoff.reply_rows` states it)."""
        prompt = np.asarray(control.prompt_token_ids, np.int64)
        p = self._reply_start(prompt)
        n_rows, complete = reply_rows([*prompt[p:].tolist(), *up.token_ids], up.finished, self.thinker_eos)
        parts = []
        if have < n_rows:
            parts.append(self._token_rows(up, p + 1 + np.arange(have, n_rows)))
        if complete and have <= n_rows:
            parts.append(self.voices.row("text_eos_embed")[None])
        if not parts:
            return np.zeros((0, self.voices.row("text_eos_embed").shape[-1]), np.float32), complete
        return np.concatenate(parts).astype(np.float32), complete

    def check_pipeline(self, pipeline) -> None:
        """ConfigError unless the pipeline's thinker returns the hidden layers the talker reads."""
        require_thinker_layers(pipeline, set(self.hidden_layers),
                               "the thinker's embeddings and last layer feed the talker")

    def check_prompt(self, prompt_token_ids) -> None:
        """Any thinker prompt can be spoken: the talker takes the thinker's rows by position (those
        of a `prompt_embeds` prompt are its embeddings), whatever the token ids."""

    def stage_input(self, kind: str, control: AddRequest, upstream: UpstreamOutputs) -> AddRequest | None:
        """The request of a `kind` stage ("talker", "token2wav") from the stage before it, with
        what is final so far (None: not enough yet; see models/handoff.py)."""
        if kind == "talker":
            return self.talker_request(control, upstream)
        if kind == "token2wav":
            codes, complete = self.codec_tokens(upstream, 0)
            if not complete and len(codes) == 0:
                return None
            return self.talker2token2wav(control, codes, control.sampling_params, control.voice,
                                         control.request_id, complete=complete)
        raise ValueError(f"Qwen2.5-Omni has no stage {kind!r} that takes another stage's output")

    def more_input(self, kind: str, control: AddRequest, upstream: UpstreamOutputs, have: int):
        """(rows or codec tokens after the first `have`, complete) of a started streamed request."""
        if kind == "talker":
            return self.reply_tail(control, upstream, have)
        if kind == "token2wav":
            return self.codec_tokens(upstream, have)
        raise ValueError(f"Qwen2.5-Omni has no stage {kind!r} that takes another stage's output")

    def codec_tokens(self, up: UpstreamOutputs, have: int) -> tuple[np.ndarray, bool]:
        """The talker's codec tokens from `have` on up to its first end token, and whether that
        end (or the talker's finish) has come."""
        codes = np.asarray(up.token_ids, np.int64)
        stop = np.flatnonzero(np.isin(codes, self.talker.eos_token_ids))
        end = int(stop[0]) if stop.size else len(codes)
        return codes[have:end].astype(np.int32), bool(stop.size) or up.finished

    def _positions(self, text_ids: np.ndarray, first: AddRequest):
        """The talker's M-RoPE positions: the thinker prompt's, continued by two text tokens."""
        return media_positions(text_ids, first.multi_modal, get_rope_index, config=self.rope)

    def talker2token2wav(self, first: AddRequest, codes, params, voice: str | None, request_id: str,
                         complete: bool = True) -> AddRequest:
        """The vocoder request: the codec tokens up to the first talker eos, and the voice."""
        codes = np.asarray(codes, np.int64)
        stop = np.isin(codes, self.talker.eos_token_ids)
        if stop.any():
            codes = codes[:int(np.argmax(stop))]
        if len(codes) == 0 and complete:
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
        codebook_size=hf.get("token2wav_config", {}).get("dit_config", {}).get("num_embeds"),
        assistant_turn=assistant_turn_ids(ckpt_dir))
