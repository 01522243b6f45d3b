#!/usr/bin/env bash
# The KDA steps of the GPU tier as one call, on a machine where `device_run.sh install`
# has run (ci/gpu/README.md), each step with its own deadline inside TOTAL_S and each
# leaving its partial results in $OUT:
#  1. tune the two KDA row views (QKVG 6144x7168, F_A/beta 144x7168) at M 1..16 into a
#     fresh cache of this run, seeded from the committed cache (the views' own earlier
#     figures, and the packed 6288x7168 row's for QKVG), lowest M first;
#     (TUNE_S 0 skips this and takes the committed run's rows);
#  2. render the SM90 table as the repository does, with them, into the installed tree;
#  3. the GPU tests: the KDA file, and the low-latency file's cases for these rows;
#  4. the KDA benchmark, M 1..16: (A) stock, (B) sequential, (C) overlap, (D) overlap with
#     the chain on a high-priority stream, the read roof; its JSON carries the overlap
#     set and stream to commit (kda_report.derive).
# Outputs in $OUT (8 files): tune_sm90_kda.json, tune.log, tune_cache_kda.tgz, gpu.log,
# pytest_kda.xml, pytest_llg_kda_rows.xml, kda_bench_sm90.json/.md.
#   bash ci/gpu/kda/device.sh [TOTAL_S] [TUNE_S]
set -uo pipefail
START=$(date +%s)
TOTAL=${1:-290} TUNE_S=${2:-115}
KDA=$(cd "$(dirname "$0")" && pwd); GPU=$(dirname "$KDA"); ROOT=$(cd "$GPU/../.." && pwd)
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
SITE=${K3_SITE:-/tmp/site} TABLE=vllm/models/kimi_k3/nvidia/low_latency_gemm_sm90.py
export PYTHONUNBUFFERED=1 K3_RUN_ID=${K3_RUN_ID:-h200-$(date -u +%Y%m%d-%H%M)-kda}
CACHE=${K3_CACHE_ROOT:-/root}/k3cache-$K3_RUN_ID  # this run's measurements only: its JSON cites it
[ -f $SITE/.k3/env.sh ] || { echo "no $SITE: run device_run.sh install first" >&2; exit 3; }
. $SITE/.k3/env.sh
cp -r "$ROOT/overlay/vllm/." $SITE/vllm/      # our overlay as in this checkout
echo "[kda] run $K3_RUN_ID, $TOTAL s in all, tune $TUNE_S s"

KDA_JSON="$OUT/tune_sm90_kda.json"
if [ "$TUNE_S" -gt 0 ]; then
  timeout -k 5 $((TUNE_S + 30)) python3 "$GPU/tune.py" --cache "$CACHE" \
    --seed-cache "$GPU/results/tune_cache" --priors "$K3_TOOLS/k3/priors.json" \
    --out "$KDA_JSON" --deadline-s "$TUNE_S" --workers 14 --run-id "$K3_RUN_ID" \
    --shape 6144x7168 --shape 144x7168 --donor 6144x7168=6288x7168 --refine-rounds 1 --wait-s 0 \
    2>&1 | grep -v "^\[kernels\]" | tee "$OUT/tune.log"
  tar -czf "$OUT/tune_cache_kda.tgz" -C "$CACHE" . 2>/dev/null
else
  KDA_JSON="$GPU/results/tune_sm90_kda.json"  # TUNE_S 0: the committed KDA run's rows
fi
# The SM90 table as the repository renders it (ci/gpu/README.md), with this run's KDA rows.
if [ -s "$KDA_JSON" ]; then
  (cd "$ROOT" && python3 ci/gpu/render_table.py ci/gpu/results/decode_gemm_sm90.json \
     --add "ci/gpu/results/tune_sm90.json@1536x128,3072x128,768x128" --add "$KDA_JSON" $SITE/$TABLE)
else
  echo "[kda] no tuner JSON: tests and benchmark use the committed table"
fi
echo "[kda] tuned and rendered at $(( $(date +%s) - START ))s"

mkdir -p /tmp/k3t/tests/kernels && cp "$ROOT"/overlay/tests/kernels/test_kimi_k3_*_gpu.py /tmp/k3t/tests/kernels/
# Tests and benchmark in one process: vLLM imports once and the CuTe configs compile once.
# The benchmark gets what is left of TOTAL_S; it rewrites its JSON after every M.
END=$(( START + TOTAL - 8 )); T=$(( END - $(date +%s) )); [ $T -ge 30 ] || T=30
cd /tmp/k3t && timeout -k 5 $T python3 - "$KDA" "$OUT" "$END" <<'PY' 2>&1 | tee "$OUT/gpu.log"
import sys
import time

import pytest

kda, out, end = sys.argv[1], sys.argv[2], float(sys.argv[3])
common = ["-p", "no:cacheprovider", "-q", "-rs", "--tb=short"]
rc = pytest.main(common + [f"--junitxml={out}/pytest_kda.xml",
                           "tests/kernels/test_kimi_k3_kda_projection_gpu.py"])
rc2 = pytest.main(common + [f"--junitxml={out}/pytest_llg_kda_rows.xml",
                            "tests/kernels/test_kimi_k3_low_latency_gemm_gpu.py",
                            "-k", "6144x7168 or 144x7168 or platform or enable"])
print(f"[kda] pytest exit codes: kda file {int(rc)}, low-latency file (new rows) {int(rc2)}", flush=True)
sys.path.insert(0, kda)
import benchmark

left = end - time.time() - 10  # one M takes ~5 s; stop before the timeout
print(f"[kda] benchmark with {left:.0f} s left", flush=True)
benchmark.main(["--json", f"{out}/kda_bench_sm90.json", "--md", f"{out}/kda_bench_sm90.md",
                "--deadline-s", str(left)])
import json

res = json.load(open(f"{out}/kda_bench_sm90.json"))
print("[kda] overlap from this run:", {k: res.get(k) for k in (
    "overlap_variant", "high_priority_aux", "overlap_tokens", "tokens_by_variant",
    "c_over_roof_weights_m_le_2", "c_within_10pct_of_roof_m_le_2")}, flush=True)
PY
echo "[kda] done in $(( $(date +%s) - START ))s"
