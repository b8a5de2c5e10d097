"""Building blocks every model is made of, below the engine and every family: `linear.py`,
`norms.py`, `mlp.py` (and the activation table), `rope.py`, `attention.py` (one metadata object,
a backend's kernels), `decoder.py`, `moe.py`, `parallel.py` (tensor and expert parallel meshes),
and the encoder layers both families' towers share (`audio_blocks.py`, `vision_blocks.py`)."""
