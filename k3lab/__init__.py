"""The kernel lab: what measures, tunes and explains the overlay's GPU kernels.

Nothing here ships. Commands run from the repository's root as ``python -m k3lab.<tool>``
(docs/gpu-lab.md); what they measure is committed under ``results/`` (results/README.md),
and raw runs, logs and tarballs go to ``~/.cache/vllm-k3-overlay/lab/`` or CI artifacts.

Shared by the lab and the rebase job's GPU stage (``ci/gpu_stage``):
  shapes       Kimi-K3 decode GEMM shapes, bytes and read roofs
  timing       the timing harness: CUDA-graph replay over rotating weights
  kernels      handles to cuBLAS, vLLM's CuTe skinny GEMM and dsv3
  candidates   handles to every backend the dispatch can route to, ours included
  tiles        swap-AB tile configs and K splits worth timing
  provenance   GPU, date, versions and run id for every results JSON
  paths        this checkout, results/ and the overlay

The tuner and the tables:
  space, tune, tune_cache, aggregate    the resumable CuTe tuner and its cache
  upstream_tables   upstream's tables as data (seeds, comparisons)
  render_table      results JSON -> the shipped ``low_latency_gemm_sm90.py`` (``--check``)

Elsewhere in the lab:
  bundle       the offline bundle for an air-gapped GPU runner
  device/      the scripts that run on the GPU machine
  bench/       the benchmarks (tool and kernels)
  experiments/ kernel experiments that are not shipped
  mutation     mutation testing of the tool and the overlay module (by hand, not in CI)
  tests/       this wing's tests
"""
