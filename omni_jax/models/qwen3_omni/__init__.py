"""Qwen3-Omni: thinker (Qwen3-MoE decoder with DeepStack, audio and vision towers) -> talker
(MoE, group-0 codes, a code predictor for the other groups) -> code2wav. `family.py` is the
family object; `specs.py` its checkpoint stages, `stages.py` and `code2wav_stage.py` its
engines, `pipeline.py` its stage hand-off, `processor.py` and `rope_index.py` its prompt rules,
`tiny.py` the built-in tiny model."""
