"""The CI job: what CI runs, and nothing else. Run from the repository root.

  rebase        the rebase job's entry (``python -m ci.rebase``)
  targets       the rebase targets as data (``targets.toml``)
  target_env    one Python environment per target, from the target's own requirements
  table_diff    upstream's low-latency GEMM tables against ours (``table_dump`` runs in
                the target's environment)
  cpu_tier      vLLM's skinny-GEMM tests and ours on the patched tree, on the CPU
  gpu_stage/    the GPU stage: numerics and the ours-vs-upstream A/B on each target tree
  prefer_overlay, pytest_no_accelerator   loaded by tests the job runs in other processes
  test.sh       README command 2; ``.ci/run`` calls it
  tests/        this wing's tests
"""
