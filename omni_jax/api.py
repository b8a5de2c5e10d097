"""The front ends: `OmniJax` (sync, batches) and `AsyncOmniJax` (async streaming).

Both start the pipeline's stage processes through an `Orchestrator` and process
prompts in the caller's process (tokenizer, chat template, media): `OmniJax` on the
caller's thread, `AsyncOmniJax` on worker threads with a time budget per prompt, so a
slow prompt never stalls the event loop. Bad input fails that request with an error
naming the problem; the others go on.

    with OmniJax(model="tiny") as omni:
        outs = omni.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}, {"prompt_embeds": rows}],
                             sampling_params=SamplingParams(temperature=0.0, max_tokens=16),  # or one per prompt
                             output_hidden_states=[0, 3])

    async for out in AsyncOmniJax(model=...).generate(prompt, request_id="r1"):
        print(out.text_delta, end="")
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import math
import operator
import queue
import sys
import time
import uuid
import weakref
from typing import AsyncIterator, Sequence

import numpy as np
from tqdm import tqdm

from .checkpoint import read_config
from .config import PipelineConfig, default_pipeline_for, load_pipeline_config
from .engine.protocol import AddRequest, MultiModalPayload, StageInputs
from .engine.sampling_params import SamplingParams, is_utf8
from .errors import ConfigError, PromptError, error_code
from .inputs.media import MediaLimits
from .inputs.processor import ProcessedPrompt
from .model_source import checkpoint_dir
from .models.registry import get_family, tiny_family
from .prompt_workers import PromptWorkers
from .runtime.orchestrator import Orchestrator, OrchestratorRequest
from .runtime.outputs import OmniRequestOutput, RequestMetrics
from .update_collector import UpdateCollector


def resolve_checkpoint_and_pipeline(model: str, pipeline, revision: str | None = None) -> tuple[str, PipelineConfig]:
    """(checkpoint directory, pipeline config) of a model (model_source.py: a built-in tiny one, a
    converted checkpoint, a Hugging Face one or Hub id, converted once) and a pipeline (preset name,
    YAML path, PipelineConfig; None: the family's default); a pipeline for another family is a
    ConfigError. `revision`: a Hub model's branch, tag or commit."""
    ckpt = checkpoint_dir(model, revision)
    cfg = read_config(ckpt)
    family, held = cfg["family"], cfg["stages"]
    if pipeline is None:
        pipeline = default_pipeline_for(family, tiny=tiny_family(model) is not None, checkpoint_stages=held)
        if pipeline.output_modalities == ("text",):
            print(f"[omni-jax] {ckpt} holds only the {', '.join(held)} stage(s): pipeline {pipeline.name!r}, "
                  "text replies only", file=sys.stderr)
    elif not isinstance(pipeline, PipelineConfig):
        pipeline = load_pipeline_config(pipeline)
    if pipeline.family != family:
        raise ConfigError(f"pipeline {pipeline.name!r} is for {pipeline.family!r} but the checkpoint "
                          f"{ckpt} is {family!r}")
    missing = pipeline.missing_stages(held)
    if missing:
        raise ConfigError(f"pipeline {pipeline.name!r} runs stage(s) {missing}, which the checkpoint {ckpt} does not "
                          f"hold (it has {held}); use pipeline {pipeline.thinker_only().name!r} for text replies")
    return ckpt, pipeline


def add_async_chunk_argument(parser, prefix: str = "") -> None:
    """The `--async-chunk/--no-async-chunk` flag of the commands that start an engine."""
    parser.add_argument("--async-chunk", action=argparse.BooleanOptionalAction, default=None,
                        help=f"{prefix}stream between stages: the talker starts while the thinker writes and audio "
                             f"comes in chunks (default: as the pipeline config says; the presets turn it on)")


# Stop and suppressed token ids a request may add to a stage's defaults: the stages' compiled samplers
# have room for their own (eos, a talker's out-of-codebook ids) and at least this many more.
MAX_REQUEST_BANNED_IDS = 32


def _first_stage_inputs(prompt_embeds, capture_hidden: bool) -> StageInputs | None:
    """The first stage's inputs beyond token ids: prompt embeddings as overlay rows (one per
    prompt token) and whether to return hidden states (the talker's, or the caller's)."""
    if prompt_embeds is None:
        return StageInputs(capture_hidden=True) if capture_hidden else None
    return StageInputs(overlay_rows=prompt_embeds, overlay_index=np.arange(len(prompt_embeds), dtype=np.int32),
                       capture_hidden=capture_hidden)


@dataclasses.dataclass(frozen=True)
class PreparedPrompt:
    """A prompt processed once by `process()`, to be given to `generate` as a prompt any number
    of times: n samples of one prompt tokenize its text and decode its media once. It serves
    the output modalities it was processed for (a speech reply's prompt differs)."""

    processed: ProcessedPrompt
    chain: tuple[str, ...]


class _Frontend:
    """Shared set-up: checkpoint, pipeline, prompt processing, orchestrator."""

    def __init__(self, model: str = "tiny", pipeline: str | PipelineConfig | None = None,
                 output_modalities: Sequence[str] = ("text",), async_chunk: bool | None = None,
                 media_limits: MediaLimits | None = None, revision: str | None = None):
        """`async_chunk`: stream between stages (None: as the pipeline config says).
        `media_limits`: what media a prompt may hold, checked before decoding (None: the defaults).
        `revision`: the branch, tag or commit of a Hugging Face Hub model (None: its main branch)."""
        if media_limits is not None and not isinstance(media_limits, MediaLimits):
            raise TypeError(f"media_limits must be a MediaLimits, got {type(media_limits).__name__}")
        self.checkpoint, self.pipeline = resolve_checkpoint_and_pipeline(model, pipeline, revision)
        if async_chunk is not None:
            if not isinstance(async_chunk, bool):
                raise ConfigError(f"async_chunk must be True, False or None, got {async_chunk!r}")
            self.pipeline = dataclasses.replace(self.pipeline, async_chunk=async_chunk)
        self.model = model
        self.output_modalities = tuple(output_modalities)
        self._stages = self._stages_for(self.output_modalities)
        family = get_family(self.pipeline.family)
        # An image is one call of the first stage's vision encoder: resized to what its largest bucket holds.
        self.processor = family.prompt_processor(self.checkpoint,
                                                 max_image_patches=self._stages[0].vision_patch_buckets[-1])
        if media_limits is not None:
            self.processor.media_limits = media_limits
        self.tokenizer = self.processor.tokenizer
        self._handoff = None
        if len(self._stages) > 1:
            self._handoff = family.handoff(self.checkpoint)
            self._handoff.check_pipeline(self.pipeline)
        self._orch = Orchestrator(self.pipeline, self.checkpoint, [s.name for s in self._stages])
        self._ids = itertools.count()

    # ------------------------------------------------------------------ helpers
    def _stages_for(self, mods: tuple[str, ...]):
        """The pipeline's stages for these output modalities; speech from a model without speech
        stages is a ConfigError naming the model."""
        if "audio" in mods and "audio" not in self.pipeline.output_modalities:
            raise ConfigError(f"model {self.model!r} speaks no audio: its pipeline {self.pipeline.name!r} delivers "
                              f"only {list(self.pipeline.output_modalities)} (a checkpoint without speech stages, "
                              "as Qwen3-Omni's Thinking and Captioner, answers in text); ask for output_modalities "
                              "['text']", field="output_modalities")
        return self.pipeline.stages_for(mods)

    def _chain(self, output_modalities) -> list[str]:
        mods = tuple(output_modalities or self.output_modalities)
        names = [s.name for s in self._stages_for(mods)]
        missing = [n for n in names if n not in self._orch.clients]
        if missing:
            raise ValueError(f"output_modalities {list(mods)} need stage(s) {missing}, which this engine did not "
                             f"start; create it with output_modalities={list(mods)}")
        return names

    def _stage_params(self, thinker: SamplingParams | None, sampling_params_list, chain) -> list[SamplingParams]:
        """One prompt's params per stage of its chain: the stages' defaults, replaced by
        `sampling_params_list` (vLLM-Omni's per-stage list, None keeps a default) and, for the
        first stage, by `thinker` (the call's `sampling_params`). ValueError if a list is too
        long or the first stage's params are given both ways."""
        per_stage = [self.pipeline.stage(n).sampling_params() for n in chain]
        given = [] if sampling_params_list is None else list(sampling_params_list)
        if len(given) > len(chain):
            raise ValueError(f"sampling_params_list has {len(given)} entries for a chain of {len(chain)} "
                             f"stages {chain}")
        for i, g in enumerate(given):
            if g is not None and not isinstance(g, SamplingParams):
                raise ValueError(f"sampling_params_list[{i}] must be a SamplingParams or None, got {type(g).__name__}")
        if thinker is not None:
            if given and given[0] is not None:
                raise ValueError(f"the {chain[0]} stage's params are given twice: in sampling_params and in "
                                 f"sampling_params_list[0]")
            given = [thinker] + given[1:]
        params = [g if g is not None else d for g, d in itertools.zip_longest(given, per_stage)]
        self._check_stage_limits(params, per_stage, chain)
        return params

    def _check_stage_limits(self, params: list[SamplingParams], defaults: list[SamplingParams], chain) -> None:
        """ValueError (naming `sampling_params_list[i].field`) for params a stage of the chain would
        refuse only once the request reached it: checked here, before any stage works on it."""
        for i, (p, d, name) in enumerate(zip(params, defaults, chain)):
            added = (set(p.stop_token_ids) | set(p.suppress_token_ids)) - (set(d.stop_token_ids) | set(d.suppress_token_ids))
            if len(added) > MAX_REQUEST_BANNED_IDS:
                raise ValueError(f"sampling_params_list[{i}].stop_token_ids: {len(added)} stop and suppressed token "
                                 f"ids for stage {name!r}, more than the {MAX_REQUEST_BANNED_IDS} a request may add")
            if i + 1 < len(chain):
                nxt = self.pipeline.stage(chain[i + 1])
                # A one-shot stage (a vocoder) takes the whole output of the stage before it, up to its max_model_len.
                if nxt.runner == "oneshot" and p.max_tokens > nxt.max_model_len:
                    field = "min_tokens" if p.min_tokens > nxt.max_model_len else "max_tokens"
                    raise ValueError(f"sampling_params_list[{i}].{field}: stage {name!r} may write {p.max_tokens} "
                                     f"tokens (max_tokens), more than the {nxt.max_model_len} stage {nxt.name!r} "
                                     f"takes (its max_model_len)")

    @staticmethod
    def _per_prompt(value, kind, n: int, name: str) -> list:
        """A call's `value` for each of its n prompts: one value for all, or a list with one per
        prompt (vLLM's meaning of a list of SamplingParams); ValueError on a wrong length."""
        if value is None or isinstance(value, kind):
            return [value] * n
        values = list(value)
        if len(values) != n:
            hint = " (per-stage params go in sampling_params_list)" if name == "sampling_params" else ""
            raise ValueError(f"{name} has {len(values)} entries for {n} prompt(s): a list gives one per prompt{hint}")
        for i, v in enumerate(values):
            if v is not None and not isinstance(v, kind):
                raise ValueError(f"{name}[{i}] must be a {kind.__name__} or None, got {type(v).__name__}")
        return values

    def _hidden_layers(self, output_hidden_states, chain) -> list[int] | None:
        """The hidden layers a call asks for, checked against what its first stage captures
        (ValueError naming them); None when it asks for none."""
        if output_hidden_states is None:
            return None
        stage = self.pipeline.stage(chain[0])
        try:
            layers = [operator.index(x) for x in output_hidden_states]
        except TypeError:
            raise ValueError(f"output_hidden_states must be a list of layer indices, "
                             f"got {output_hidden_states!r}") from None
        missing = sorted(set(layers) - set(stage.hidden_layers))
        if missing:
            raise ValueError(f"output_hidden_states {missing} are not captured by stage {stage.name!r}, which "
                             f"captures layers {list(stage.hidden_layers)} (its hidden_layers in the pipeline config)")
        return sorted(set(layers))

    def _prepare(self, prompt, output_modalities) -> PreparedPrompt:
        chain = self._chain(output_modalities)
        return PreparedPrompt(self._process(prompt, chain), tuple(chain))

    def _process(self, prompt, chain):
        """The processed prompt (raises PromptError, whatever the prompt trips over)."""
        if isinstance(prompt, PreparedPrompt):
            if prompt.chain != tuple(chain):
                raise PromptError(f"the prompt was processed for stages {list(prompt.chain)}, this request runs "
                                  f"{list(chain)}; process it for these output_modalities")
            return prompt.processed
        try:
            # A prompt plus one generated token must fit the first stage (scheduler.add_request).
            return self.processor.process(prompt, speech_output=len(chain) > 1,
                                          max_prompt_len=self.pipeline.stage(chain[0]).max_model_len - 1)
        except PromptError:
            raise
        except Exception as e:  # whatever a hostile prompt trips over is that prompt's error
            raise PromptError(f"{type(e).__name__}: {e}") from e

    def _request(self, prompt, params: list[SamplingParams], chain, request_id: str, sink,
                 voice: str | None = None, hidden_layers: list[int] | None = None,
                 include_prompt: bool = False, timeout_s: float | None = None) -> OrchestratorRequest:
        """Process the prompt (raises PromptError) and build the orchestrator request."""
        p = self._process(prompt, chain)
        mm = p.multi_modal
        if mm is not None and not isinstance(mm, MultiModalPayload):
            raise PromptError(f"'multi_modal_data' must be a MultiModalPayload, got {type(mm).__name__}")
        speech = len(chain) > 1
        if speech:
            try:
                voice = self._handoff.voices.get(voice).name
                self._handoff.check_prompt(p.prompt_token_ids)
            except ValueError as e:
                raise PromptError(str(e)) from None
        first = AddRequest(request_id=request_id, prompt_token_ids=p.prompt_token_ids, sampling_params=params[0],
                           multi_modal=mm, arrival_time=time.monotonic(),
                           inputs=_first_stage_inputs(p.prompt_embeds, speech or hidden_layers is not None),
                           output_hidden_states=hidden_layers, hidden_states_include_prompt=bool(include_prompt))
        out = OmniRequestOutput(request_id=request_id, prompt_token_ids=p.prompt_token_ids.tolist(),
                                metrics=RequestMetrics(arrival_time=first.arrival_time))
        return OrchestratorRequest(first=first, chain=chain, sink=sink, output=out, stage_params=params, voice=voice,
                                   deadline=None if timeout_s is None else first.arrival_time + timeout_s)

    @staticmethod
    def _check_timeout(timeout_s) -> None:
        if timeout_s is not None and (not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool)
                                      or not 0 < timeout_s < math.inf):
            raise ValueError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}")

    def _new_id(self) -> str:
        return f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    def abort(self, request_id: str) -> None:
        """Stop a request in every stage; it finishes with finish_reason 'abort'."""
        self._orch.abort(request_id)

    @property
    def voices(self) -> list[str]:
        """The voices a speech reply can take, the default first (empty: no speech stages)."""
        if self._handoff is None:
            return []
        v = self._handoff.voices
        return [v.default, *(n for n in v.names if n != v.default)]

    @property
    def audio_seconds_per_call(self) -> float:
        """The audio one call of the thinker's audio encoder takes (its largest audio bucket): longer
        audio in a prompt takes several calls, and a transcription is cut into pieces of at most this."""
        return self.processor.audio_seconds(self._stages[0].audio_chunk_buckets[-1])

    def shutdown(self) -> None:
        """Stop every stage process; the object cannot be used afterwards."""
        self._orch.shutdown()

    def stage_stats(self, timeout_s: float = 10.0) -> dict[str, dict]:
        """Engine stats of every stage (KV cache usage, queue lengths, compilations...)."""
        return self._orch.stage_stats(timeout_s)

    def stage_pids(self) -> dict[str, int]:
        """Process ids of the stage workers."""
        return {n: c.process.pid for n, c in self._orch.clients.items()}

    def health(self) -> tuple[str | None, list[str]]:
        """(why the engine cannot serve again, or None; the stages being restarted now)."""
        return self._orch.dead, [n for n, c in self._orch.clients.items() if c.restarting is not None]


class OmniJax(_Frontend):
    """Synchronous front end: `generate` takes a batch and returns finished outputs."""

    def process(self, prompt, output_modalities: Sequence[str] | None = None) -> PreparedPrompt:
        """The prompt processed once for `generate(..., output_modalities)` (raises PromptError)."""
        return self._prepare(prompt, output_modalities)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 output_modalities: Sequence[str] | None = None, voice: str | Sequence[str] | None = None,
                 use_tqdm: bool = True, output_hidden_states: Sequence[int] | None = None,
                 hidden_states_include_prompt: bool = False,
                 sampling_params_list: Sequence[SamplingParams | None] | None = None,
                 timeout_s: float | None = None) -> list[OmniRequestOutput]:
        """Run every prompt to completion; outputs in prompt order.

        A prompt that cannot be processed gets an output with `error` set and
        finish_reason "error"; the rest of the batch still runs. `voice` picks the
        speaker of speech replies (an unknown one is such an error, naming the voices).
        `sampling_params` is the first stage's (the thinker's): one for every prompt, or a list
        with one per prompt (as vLLM's); `voice` likewise. `sampling_params_list` sets the params
        of every stage of the chain (vLLM-Omni's name: [thinker, talker, vocoder], None keeps a
        stage's default) for all prompts. A list of the wrong length is a ValueError.
        `use_tqdm` shows a progress bar of finished requests on stderr, as vLLM's.
        `output_hidden_states`: thinker layers (HF indexing: 0 = input embeddings, num_layers =
        after the final norm; only layers the stage's `hidden_layers` capture, else ValueError)
        returned in `out.hidden_states` as [T, H] per layer: one row per generated token fed back,
        after the prompt's rows with `hidden_states_include_prompt`.
        `timeout_s`: each request's deadline from its submission; past it the request finishes
        with finish_reason "timeout" (its output so far kept) and frees every stage.
        """
        self._check_timeout(timeout_s)
        if isinstance(prompts, (str, dict, PreparedPrompt)):
            prompts = [prompts]
        prompts = list(prompts)
        chain = self._chain(output_modalities)
        params = [self._stage_params(sp, sampling_params_list, chain)
                  for sp in self._per_prompt(sampling_params, SamplingParams, len(prompts), "sampling_params")]
        voices = self._per_prompt(voice, str, len(prompts), "voice")
        layers = self._hidden_layers(output_hidden_states, chain)
        done: queue.SimpleQueue = queue.SimpleQueue()
        results: dict[str, OmniRequestOutput] = {}
        order, submitted = [], set()
        try:
            for prompt, prompt_params, prompt_voice in zip(prompts, params, voices):
                rid = self._new_id()
                order.append(rid)
                try:
                    req = self._request(prompt, prompt_params, chain, rid, lambda o: o.finished and done.put(o),
                                        prompt_voice, layers, hidden_states_include_prompt, timeout_s)
                except PromptError as e:
                    results[rid] = OmniRequestOutput(request_id=rid, finished=True, finish_reason="error",
                                                     error=f"bad prompt: {e}", error_code=error_code(e))
                    continue
                self._orch.submit(req)
                submitted.add(rid)
            with tqdm(total=len(order), desc="generate", unit="req", disable=not use_tqdm) as bar:
                bar.update(len(results))
                while submitted - results.keys():
                    out = done.get()
                    results[out.request_id] = out
                    bar.update(1)
        except BaseException:
            # Ctrl-C or a dead engine: nothing this call started may keep running.
            for rid in submitted - results.keys():
                self._orch.abort(rid)
            raise
        return [results[r] for r in order]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


class _Unsubmitted:
    """An AsyncOmniJax request from its generate() call until the orchestrator has it: an abort
    meanwhile is kept here, since the orchestrator does not know the id yet."""

    __slots__ = ("request_id", "aborted", "__weakref__")

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.aborted = False


class AsyncOmniJax(_Frontend):
    """Asynchronous front end: `generate` is an async generator of updates (text deltas, audio chunks)."""

    def __init__(self, model: str = "tiny", pipeline: str | PipelineConfig | None = None,
                 output_modalities: Sequence[str] = ("text",), async_chunk: bool | None = None,
                 prompt_workers: int = 4, prompt_timeout_s: float = 30.0, media_limits: MediaLimits | None = None,
                 max_queued_prompts: int | None = None, revision: str | None = None):
        """`prompt_workers`: threads that process prompts (chat template, tokenizer, media) off the
        event loop. `prompt_timeout_s`: a prompt whose processing takes longer fails with a
        PromptError (and its processing stops). `max_queued_prompts`: how many prompts may wait for
        a worker; more make `generate` raise `Overloaded` (None: no bound). Other arguments as `OmniJax`."""
        # first: a bad value starts nothing
        self._prompts = PromptWorkers(prompt_workers, prompt_timeout_s, max_queued_prompts)
        # Requests between generate() and their submission (weak: an iterator never run just goes).
        self._unsubmitted: weakref.WeakSet[_Unsubmitted] = weakref.WeakSet()
        try:
            super().__init__(model, pipeline, output_modalities, async_chunk, media_limits, revision)
        except BaseException:
            self._prompts.shutdown()
            raise

    async def process(self, prompt, output_modalities: Sequence[str] | None = None) -> PreparedPrompt:
        """The prompt processed once, on the prompt workers, for `generate(..., output_modalities)`;
        raises as `generate`'s first step does (PromptError, Overloaded)."""
        return await self._prompts.run(self._prepare, prompt, output_modalities)

    def generate(self, prompt, sampling_params: SamplingParams | None = None,
                 request_id: str | None = None, output_modalities: Sequence[str] | None = None,
                 voice: str | None = None, output_hidden_states: Sequence[int] | None = None,
                 hidden_states_include_prompt: bool = False,
                 sampling_params_list: Sequence[SamplingParams | None] | None = None,
                 timeout_s: float | None = None) -> AsyncIterator[OmniRequestOutput]:
        """An async iterator of OmniRequestOutput updates until the request finishes. Updates
        that arrive while the caller is busy come as one (their deltas joined, as vLLM does).

        Raises PromptError (a ValueError) for a prompt that cannot be processed, or whose
        processing (on a worker thread) outlasts `prompt_timeout_s`; `Overloaded` when
        `max_queued_prompts` prompts wait already. Cancelling the first `__anext__` stops the
        prompt's processing.
        Leaving the loop early (break, cancellation) aborts the request; so does `abort(request_id)`
        at any time after this call, even before the iterator first runs.
        `sampling_params` (the thinker's), `sampling_params_list` (per stage),
        `output_hidden_states` / `hidden_states_include_prompt` as `OmniJax.generate`; the
        hidden states come with the final update; `timeout_s` as `OmniJax.generate`.
        """
        self._check_timeout(timeout_s)
        if request_id is not None and not (isinstance(request_id, str) and is_utf8(request_id)):
            # Stages could not read the request (a stage drops what it cannot decode): refused here.
            raise ValueError(f"request_id must be a string of UTF-8 text, got {request_id!r}")
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be one SamplingParams (the first stage's), got "
                             f"{type(sampling_params).__name__}; per-stage params go in sampling_params_list")
        chain = self._chain(output_modalities)
        # A plain method, not an async generator, so that the request is known to `abort` from
        # this call on (an async generator's body, and with it the submission, waits for its first run).
        ticket = _Unsubmitted(request_id or self._new_id())
        self._unsubmitted.add(ticket)
        return self._stream(ticket, prompt, self._stage_params(sampling_params, sampling_params_list, chain), chain,
                            voice, self._hidden_layers(output_hidden_states, chain), hidden_states_include_prompt,
                            timeout_s)

    def abort(self, request_id: str) -> None:
        """Stop a request in every stage (finish_reason 'abort'), also one not submitted yet."""
        for ticket in list(self._unsubmitted):
            if ticket.request_id == request_id:
                ticket.aborted = True
        super().abort(request_id)

    async def _stream(self, ticket: "_Unsubmitted", prompt, params: list[SamplingParams], chain, voice,
                      hidden_layers, include_prompt: bool, timeout_s) -> AsyncIterator[OmniRequestOutput]:
        updates = UpdateCollector(asyncio.get_running_loop())
        rid = ticket.request_id
        try:
            args = (prompt, params, chain, rid, updates.put, voice, hidden_layers, include_prompt, timeout_s)
            # A prepared prompt leaves nothing slow to do: built here, it takes no worker or queue place.
            req = self._request(*args) if isinstance(prompt, PreparedPrompt) else \
                await self._prompts.run(self._request, *args)
            if ticket.aborted:
                yield OmniRequestOutput(request_id=rid, prompt_token_ids=req.output.prompt_token_ids, finished=True,
                                        finish_reason="abort")
                return
            self._orch.submit(req)
        finally:
            self._unsubmitted.discard(ticket)
        if ticket.aborted:  # came from another thread between the check and the submission
            self._orch.abort(rid, req)
        finished = False
        try:
            while not finished:
                out = await updates.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._orch.abort(rid, req)

    def shutdown(self) -> None:
        """Stop every stage process and the prompt workers; the object cannot be used afterwards."""
        self._prompts.shutdown()
        super().shutdown()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.shutdown()
