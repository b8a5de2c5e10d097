"""Qwen2.5-Omni: thinker (Qwen2 decoder, audio and vision towers) -> talker (codec tokens) ->
token2wav (DiT + BigVGAN). `family.py` is the family object; `specs.py` its checkpoint stages,
`stages.py` its engines, `pipeline.py` its stage hand-off, `processor.py` and `rope_index.py`
its prompt rules, `tiny.py` the built-in tiny model."""
