"""The model families and what they are built of.

* `<family>/` (`qwen2_5_omni/`, `qwen3_omni/`): the modules of one family and ONE object,
  `family.py: FAMILY` (`family.ModelFamily`), through which everything above reaches it:
  checkpoint stages and conversion mapping, engine builders (served and around a module, for
  the GPU tier), stage hand-off, prompt processor, the built-in tiny model.
* `registry.py`: a family by name or HF `model_type`, imported on first use.
* `layers/`: the building blocks below every family (decoder, attention over a backend's
  kernels, MoE, RoPE, the encoders' shared layers).
* What the families share a layer up: `thinker_media.py` (running a thinker's encoders per
  request), `handoff.py` (the stage hand-off's common steps), `random_checkpoint.py` /
  `random_weights.py` (the built-in tiny checkpoints).

A family imports nothing of another family.
"""
