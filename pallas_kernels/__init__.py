"""Pallas kernels of dspark_jax, each beside its pure-JAX reference.

- ``backend``: the one switch between the Pallas kernels (Triton lowering on a GPU, interpret
  mode elsewhere) and the XLA references.
- ``kv_fp8``: the fp8 KV row layout and the in-place quantise-and-scatter write kernel.
- ``ragged_attention`` + ``attention_metadata``: ragged MQA latent attention with a sink over a
  window ring and compressed entries (bf16 or fp8 pools); ``attention_configs``: its tile
  configurations by shape, from the tuned table ``attention_configs.json``.
- ``compressor_pool``: the compressors' gather, softmax pool and ring update at decode / verify
  in one launch (with the closed windows' entries: ``pool_write``).
- ``kv_rows``, ``rms_norms``, ``rope``, ``index_scores``, ``gemv``, ``grouped_matmul``, ``hc_fused``,
  ...: docs/kernels.md lists every module.
- ``horizontal``: independent kernels in one launch (a one-token step's new rows of a layer).
- ``top_k``: the indexer's top-k by rank at decode / verify (``lax.top_k``'s indices, one launch).
- ``lowering``: deviceless lowering for a gfx950 (ROCm) target, the CI legality check.

gfx950 (AMD MI350X / MI355X) support is verified by lowering only until the kernels have run on
AMD hardware.
"""

from pallas_kernels import attention_configs, attention_metadata, backend, kv_fp8, lowering, ragged_attention
from pallas_kernels.attention_metadata import RaggedMeta
from pallas_kernels.kv_fp8 import Fp8Rows

__all__ = ["attention_configs", "attention_metadata", "backend", "kv_fp8", "lowering", "ragged_attention", "RaggedMeta",
           "Fp8Rows"]
