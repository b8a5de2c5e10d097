"""The engine a server serves: started in the background, with readiness and stage death.

The HTTP port opens at once (so /health can answer 503 "loading" while the stages load
and compile); `ServedEngine.start` builds the `AsyncOmniJax` in a daemon thread. A stage
that dies is seen through its process id (public `stage_pids`) or through the error the
library raises on submission; either makes the server unhealthy (503) for good. A stage the
library is restarting (auto_restart) makes it unhealthy until the stage is back.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable, Sequence

from ..api import AsyncOmniJax, resolve_checkpoint_and_pipeline
from ..config import PipelineConfig
from ..inputs.reasoning import END, START, ThinkTags

log = logging.getLogger("omni_jax.server")
REASONING_PARSERS = ("auto", "qwen3", "none")


def _resolved(model: str, pipeline: str | None) -> PipelineConfig | None:
    """The model's pipeline, or None when the model or pipeline cannot be resolved (loading then
    fails and says why)."""
    try:
        return resolve_checkpoint_and_pipeline(model, pipeline)[1]
    except Exception:
        return None


class ServedEngine:
    """One AsyncOmniJax under a served model name, and the server's view of its health."""

    def __init__(self, model: str, served_name: str, pipeline: str | None = None,
                 output_modalities: Sequence[str] | None = None, on_failed: Callable[[], None] | None = None,
                 async_chunk: bool | None = None, engine_options: dict | None = None,
                 reasoning_parser: str = "auto"):
        """`output_modalities`: what the engine is started for (None: all the model's pipeline
        delivers: text alone for a checkpoint without speech stages).
        `engine_options`: more AsyncOmniJax arguments (prompt_workers, prompt_timeout_s, media_limits).
        `reasoning_parser`: "qwen3" reads replies' thinking apart from their answers (inputs/reasoning.py),
        "none" does not, "auto" does for a checkpoint without speech stages whose vocabulary has the
        tags (Qwen3-Omni-30B-A3B-Thinking: the Qwen-Omni that reasons has no talker)."""
        if reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; use one of {list(REASONING_PARSERS)}")
        self.model, self.served_name = model, served_name
        resolved = _resolved(model, pipeline)
        self.pipeline = resolved or pipeline  # resolved once: the engine loads this one
        self.engine_options = dict(engine_options or {})
        self.async_chunk = async_chunk  # None: as the pipeline says
        self.on_failed = on_failed  # e.g. stop the HTTP server: a server that can never serve should exit
        speaks = resolved is None or "audio" in resolved.output_modalities
        self.output_modalities = list(output_modalities or (["text", "audio"] if speaks else ["text"]))
        # Why a request for audio is refused, if it is.
        self.no_audio_reason = (f"model {served_name!r} answers in text only (its checkpoint has no speech stages)"
                                if not speaks else "this server was started without audio output (--modalities text)")
        # "auto" reads reasoning only where there is no talker to speak the thinking
        self.reasoning_parser = "none" if reasoning_parser == "auto" and speaks else reasoning_parser
        self.reasoning: ThinkTags | None = None  # the tags' ids when replies are read for reasoning
        self.omni = None
        self.state = "loading"          # loading -> ready -> dead | stopped; or failed
        self.reason = "the model is loading and compiling"
        self.started = time.time()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Build the engine in a daemon thread (stage processes exit with their parent if we do)."""
        self._thread = threading.Thread(target=self._load, name="omni-jax-server-load", daemon=True)
        self._thread.start()
        threading.Thread(target=self._report_loading, name="omni-jax-server-progress", daemon=True).start()

    def _report_loading(self, period_s: float = 20.0) -> None:
        """A line now and then while the stages compile (minutes for a real model), so a silent
        console does not look like a hang."""
        t0 = time.monotonic()
        while not self._ready.wait(period_s):
            print(f"omni-jax serve: still loading and compiling ({time.monotonic() - t0:.0f}s)", flush=True)

    def _load(self) -> None:
        t0 = time.monotonic()
        try:
            self.omni = AsyncOmniJax(model=self.model, pipeline=self.pipeline,
                                     output_modalities=self.output_modalities, async_chunk=self.async_chunk,
                                     **self.engine_options)
            self.reasoning = self._think_tags()
        except Exception as e:  # the server stays up to report it on /health
            self.state, self.reason = "failed", f"the engine failed to start: {type(e).__name__}: {e}"
            print(f"omni-jax serve: error: {self.reason}", file=sys.stderr, flush=True)
            if self.on_failed is not None:
                self.on_failed()
        else:
            if self.state == "loading":
                self.state, self.reason = "ready", ""
                print(f"omni-jax serve: ready ({time.monotonic() - t0:.1f}s to load and compile; "
                      f"stage pids {self.stage_pids()})", flush=True)
        self._ready.set()

    def _think_tags(self) -> ThinkTags | None:
        if self.reasoning_parser == "none":
            return None
        tags = ThinkTags.of(self.omni.tokenizer)
        if tags is None and self.reasoning_parser != "auto":
            self.omni.shutdown()
            raise ValueError(f"--reasoning-parser {self.reasoning_parser}: the tokenizer does not have {START} and "
                             f"{END} as single tokens (the model does not reason); use --reasoning-parser none")
        return tags

    def wait(self, timeout: float | None = None) -> bool:
        """Block until loading ends (ready or failed)."""
        return self._ready.wait(timeout)

    def stage_pids(self) -> dict[str, int]:
        return self.omni.stage_pids() if self.omni is not None else {}

    @property
    def voices(self) -> list[str]:
        """The voices a reply can be spoken in, the default first (none: this server speaks no audio)."""
        return self.omni.voices if "audio" in self.output_modalities else []

    def stage_names(self, modalities: Sequence[str]) -> list[str]:
        """The stages a request with these output modalities runs through, in order."""
        return [s.name for s in self.omni.pipeline.stages_for(tuple(modalities))]

    def stage_defaults(self, names: list[str]):
        """The pipeline's default SamplingParams of these stages."""
        return [self.omni.pipeline.stage(n).sampling_params() for n in names]

    def mark_dead(self, reason: str) -> None:
        if self.state == "ready":
            self.state, self.reason = "dead", reason
            log.error("engine unhealthy: %s", reason)

    def check(self) -> tuple[bool, str]:
        """(healthy, why not): ready, no stage dead for good and none restarting."""
        if self.state == "ready":
            dead, restarting = self.omni.health()
            if dead is not None:
                self.mark_dead(f"{dead}; restart the server")
            elif restarting:
                return False, f"stage {restarting[0]!r} is restarting"
        return self.state == "ready", self.reason

    def shutdown(self) -> None:
        """Stop every stage process. A load still in progress is left behind: its stage
        processes exit on their own when this process does (they watch their parent)."""
        if self.state != "failed":
            self.state, self.reason = "stopped", "the server is shutting down"
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(1.0)
        if self.omni is not None:
            self.omni.shutdown()
