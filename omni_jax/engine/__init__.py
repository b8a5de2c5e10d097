"""One stage's engine: what runs inside a stage process, the same for every model family.

It imports only the building blocks (`models/layers`) and the kernels below it, never a family
(`tests/test_layers.py`); a family hands it a module and a few numbers (widths, end ids).

* `stage_engine.py`: `StageEngine`, all the stage loop asks of an engine.
* `ar_engine.py` (`AREngine`): an autoregressive stage (thinker, talker). Each `step()` schedules
  (`scheduler.py`; the KV blocks it hands out: `kv_cache.py`), runs one bucketed jitted step
  (`runner.py`: `StepInputs` in, logits out), samples on the device (`sampling_params.py`: a
  request's parameters; `sampling_metadata.py`: one step's arrays; `sampling.py`: the sampler)
  and returns `StageOutput`s.
* `oneshot_engine.py` (`OneShotEngine`): a stage without KV cache (the vocoders), batched
  through a family's synthesizer, whole requests or streamed chunks.
* `protocol.py`: the engine's request (`Request`) and the msgspec messages between processes.
* `jitted.py`: each compiling object's named programs (`Jitted`); `buckets.py`: the shapes
  they are compiled for; `stable_buffers.py`: the step buffers that keep their addresses (a
  CUDA graph is recorded again when one moves); `sharding.py`: a stage over several devices;
  `hidden_cache.py`: captured hidden rows of cached prefixes.

A request's bad input is a `RequestError` naming it; the other requests go on and its KV
blocks return to the pool.
"""
