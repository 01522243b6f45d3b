"""Try to build vLLM v0.28.0's dsv3 fused-A CUDA source with torch's extension builder.

On the GPU machine (nvcc present), compiles ``csrc/libtorch_stable/
dsv3_fused_a_gemm.cu`` from the bundle plus ``dsv3_schema.cpp`` for sm_90a into a
shared library that registers ``torch.ops._C.dsv3_fused_a_gemm``, then smoke-
checks it on one supported shape (7168 -> 1536, M=4) against a float64
reference. Prints ``DSV3_LIB=<path>`` on success; on failure prints why and
exits 1 (the tuner then simply has no dsv3 candidate). Log: stdout.

Usage: ``python -m k3lab.device.dsv3_build --csrc $K3_TOOLS/k3/csrc --out /root/dsv3``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--csrc", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    import torch
    from torch.utils.cpp_extension import load

    here = os.path.dirname(os.path.abspath(__file__))
    t0 = time.time()
    try:
        load(
            name="k3_dsv3_fused_a",
            sources=[os.path.join(args.csrc, "libtorch_stable/dsv3_fused_a_gemm.cu"),
                     os.path.join(here, "dsv3_schema.cpp")],
            extra_include_paths=[args.csrc],
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a"],
            extra_ldflags=["-lcublas"],
            build_directory=args.out,
            is_python_module=False,
            verbose=True,
        )
    except Exception:
        print(f"DSV3_BUILD_FAILED after {time.time() - t0:.0f}s (torch {torch.__version__}):")
        traceback.print_exc(file=sys.stdout)
        return 1
    lib = os.path.join(args.out, "k3_dsv3_fused_a.so")
    print(f"built {lib} in {time.time() - t0:.0f}s")
    x = torch.randn(4, 7168, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1536, 7168, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(4, 1536, device="cuda", dtype=torch.bfloat16)
    torch.ops._C.dsv3_fused_a_gemm(out, x, w.t(), True)
    ref = x.double() @ w.double().t()
    err = float((out.double() - ref).norm() / ref.norm())
    print(f"smoke 7168->1536 M=4 rel err {err:.2e}")
    if not err < 1e-2:
        print("DSV3_BUILD_FAILED: wrong result")
        return 1
    print(f"DSV3_LIB={lib}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
