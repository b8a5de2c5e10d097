"""Compile OmniJax's GPU programs for H100 / A100 without a GPU, and plan memory from them.

A tool over the engine and the models (nothing in the library imports it):

* `targets`: the XLA GPU target configs kept in `targets/*.txtpb`;
* `programs`: every jitted program of a real-size stage (kernels, steps, sampler,
  encoders, vocoders), with abstract arguments; models come from `real_configs/`
  through `nnx.eval_shape`, so no weights exist;
* `aot`: deviceless compilation and what it shows (memory, launches in and outside
  command buffers, shared memory, registers and spills of the Pallas kernels);
* `hlo_bytes`: the HBM bytes a compiled program's kernels move, from its optimized HLO;
* `roofline`: the weight bytes a decode step must read (the floor the plan and the GPU
  check measure a step against);
* `worker`: one process per target compiling a selection; `client` starts it;
* `plan`: `omni-jax plan`, the memory / roofline table of a preset.

Environment choice: the compile-only packages (`jax-cuda12-plugin`, `jax-cuda12-pjrt`,
`nvidia-cuda-nvcc-cu12`) live in their own venv, `.venv-gpu` (made by `.ci/setup`, with
this project installed too), never in `.venv`. With the plugin installed and no CUDA
driver, every JAX program that leaves `JAX_PLATFORMS` unset prints a "Jax plugin
configuration error ... Unable to load CUDA" traceback; keeping the plugin apart means the
demo, the CLI and the library can never show it, with no platform pinning anywhere. The
compile work runs in `.venv-gpu` subprocesses (`client.run_workers`), started with
`JAX_PLATFORMS=cpu` (the plugin then registers without checking for a driver) and XLA
pointed at pip's ptxas (`--xla_gpu_cuda_data_dir`).
"""
