"""Decode-GEMM comparison on the GPU: our swap-AB kernel against every other candidate.

Issue 12's benchmark. It shares ``k3lab/tiles.py`` (swap-AB tile configs and K splits
worth timing per shape) and ``k3lab/candidates.py`` (callables for every backend) with the
rest of the lab and the rebase job's GPU stage:

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

Timing is ``k3lab/timing.py``'s (CUDA-graph replay over >= 256 MiB of rotating weights,
median), so every figure here is comparable with the CuTe tuner's.
"""
