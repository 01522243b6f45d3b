"""Kernel experiments: code that answers one question on the GPU and is not shipped.

  balance             ragged swap-AB tiles, split-K reductions and pipeline depths
                      (results/balance/)
  cute_cluster        a CuTe DSL split-K kernel reduced through a cluster's shared memory
  cute_cluster_bench  its check and timing phases on the H200 (results/cute_cluster/)
"""
