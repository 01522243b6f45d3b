"""The rebase job's GPU stage: numerics and ours-vs-upstream timing on each target tree.

For every target tree the rebase job built, with the CuTe DSL release that target pins:

* ``run.py tests``: vLLM's own ``tests/kernels/test_bf16_skinny_gemm.py`` (the tree as
  built) and our ``tests/kernels/test_kimi_k3_low_latency_gemm_gpu.py`` (with our
  overlay module ahead of the tree's where the job's merge of it conflicted), pytest on
  the GPU, counts as the report's ``gpu`` section;
* ``run.py ab``: for every (N, K, M) in the union of upstream's table for this GPU's
  architecture and ours, upstream's choice, ours and cuBLAS timed back to back in one
  process (``ab.py``, timing method of ``k3lab/timing.py``), as the report's ``ab``.

``stage.py`` is the host side: what the job hands a GPU machine per target (the tree,
``meta.json`` with both tables as read by ``ci/table_diff.py``), running the stage on a
GPU runner with package access, and attaching results (from there or from the offline
bundle's air-gapped run) to the job's reports. Kernels, shapes and timing come from
``k3lab/`` (reused, not copied).
"""
