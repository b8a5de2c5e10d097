"""Hugging Face Qwen-Omni checkpoints -> OmniJax checkpoints (`omni-jax convert`): `convert.py`
(per stage, through the family's conversion mapping), `mapping.py` (names and layouts onto NNX
parameter paths), `safetensors_reader.py` (without torch)."""
