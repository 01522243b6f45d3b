"""The benchmarks, one home: each prints its figures and writes them as JSON with the run's
provenance (docs/gpu-lab.md, results/README.md).

  apply       the apply job's wall time against raw ``git am`` (CPU)
  wheel       ``--build-wheel``'s steps (CPU)
  gemm        µs per call: cuBLAS, our SM90 table, vLLM v0.29.0's SM90 table (GPU)
  chain       a table's GEMMs back to back in one CUDA graph, per table, with and without norms (GPU)
  kda         the KDA decode projections: stock, sequential, two-stream overlap (GPU)
  kda_report  the KDA benchmark's pure part: roofs, where the overlap pays, markdown
  decode_gemm/  every backend on every decode shape and M: the SM90 table's source run (GPU)
"""
