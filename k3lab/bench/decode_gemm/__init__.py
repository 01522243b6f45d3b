"""Decode-GEMM comparison on the GPU: our swap-AB kernel against every other candidate.

Issue 12's tooling, a package of its own (the CuTe tuner stays in ``ci/gpu/``):

* ``tiles``: swap-AB tile configs and K splits worth timing per shape (pure).
* ``candidates``: callables ``f(x, w) -> y`` for cuBLAS, vLLM's CuTe skinny GEMM,
  vLLM's ``ll_bf16`` (+ cast), FlashInfer's ``tinygemm_bf16`` and ours (GPU; each
  backend only where it is installed).
* ``sweep``: times our configs over every SM90 shape, picks one per shape (GPU).
* ``phases``: what each phase of a figures run times, in what order, and the merge of
  their part JSONs (pure).
* ``figures``: one phase of the figures run: every shape x M for its backends next to
  cuBLAS, two passes (core: also the read roof and a trivial-kernel floor), written
  unit by unit (GPU; the bundle for CuTe / ll_bf16, FlashInfer for tinygemm).
* ``runner``: the figures run: one child process per phase under deadlines, a unit that
  hangs killed and skipped with its reason, the merged JSON after every phase (CPU side).
* ``winners``: each (shape, M)'s backend from a figures JSON, and the targets (pure).
* ``plot``: fraction of the read roof per (shape, M), before and after (matplotlib).
* ``targets``: the run's figures against issue 12's targets as markdown (pure).

Timing is ``ci/gpu/timing.py``'s (CUDA-graph replay over >= 256 MiB of rotating weights,
median), so every figure here is comparable with the CuTe tuner's.
"""
