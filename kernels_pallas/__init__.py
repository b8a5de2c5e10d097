"""Pallas GPU kernels for paged attention, with pure-JAX references.

``paged_attention`` (decode; ``paged_attention_with_write`` also stores the step's K/V),
``ragged_paged_attention`` (packed prefill chunks), ``grouped_matmul`` (the MoE experts),
``moe_route`` (a decode step's MoE routing), ``rms_norm`` (with the residual add before
it) and ``skinny_matmul`` (a decode step's few rows through a dense projection) run as Pallas
Triton kernels on NVIDIA GPUs; ``reference`` holds XLA versions of the
same signatures (the CPU backend); ``write_kv_pages`` stores new tokens' K/V at a slot
mapping; ``page_dtype`` says what dtype a backend's pages are stored in.
"""
from kernels_pallas import reference
from kernels_pallas.grouped_matmul import grouped_matmul
from kernels_pallas.kv_update import page_dtype, write_kv_pages
from kernels_pallas.moe_route import moe_route
from kernels_pallas.paged_attention import paged_attention, paged_attention_with_write
from kernels_pallas.ragged_paged_attention import ragged_paged_attention
from kernels_pallas.rms_norm import rms_norm
from kernels_pallas.skinny_matmul import skinny_matmul

__all__ = ["paged_attention", "paged_attention_with_write", "ragged_paged_attention", "grouped_matmul",
           "moe_route", "rms_norm", "skinny_matmul", "write_kv_pages", "page_dtype", "reference"]
