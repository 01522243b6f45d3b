// Op schema for a standalone build of vLLM v0.28.0's dsv3 fused-A GEMM
// (csrc/libtorch_stable/dsv3_fused_a_gemm.cu registers only the CUDA impl; in
// vLLM the schema lives in the big _C binding file, which we do not build).
// Same signature as v0.28.0's torch.ops._C.dsv3_fused_a_gemm so callers match.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY_FRAGMENT(_C, m) {
  m.def(
      "dsv3_fused_a_gemm(Tensor! output, Tensor mat_a, Tensor mat_b, "
      "bool enable_pdl=False) -> ()");
}
