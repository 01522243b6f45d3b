#!/usr/bin/env bash
# The KDA steps of the GPU tier as one call, on a machine where `k3lab/device/run.sh install`
# has run (docs/gpu-lab.md), each step with its own deadline inside TOTAL_S and each
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
# Outputs in $OUT (8 files): tune_sm90_kda.json, tune.log, tune_cache_kda/<GPU>.jsonl.gz, gpu.log,
# pytest_kda.xml, pytest_llg_kda_rows.xml, kda_bench_sm90.json/.md.
#   bash k3lab/device/kda.sh [TOTAL_S] [TUNE_S]
set -uo pipefail
START=$(date +%s)
TOTAL=${1:-290} TUNE_S=${2:-115}
ROOT=$(cd "$(dirname "$0")/../.." && pwd); R=$ROOT/results/sm90
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
SITE=${K3_SITE:-/tmp/site} TABLE=vllm/models/kimi_k3/nvidia/low_latency_gemm_sm90.py
export PYTHONUNBUFFERED=1 K3_RUN_ID=${K3_RUN_ID:-h200-$(date -u +%Y%m%d-%H%M)-kda}
CACHE=${K3_CACHE_ROOT:-/root}/k3cache-$K3_RUN_ID  # this run's measurements only: its JSON cites it
[ -f $SITE/.k3/env.sh ] || { echo "no $SITE: run k3lab/device/run.sh install first" >&2; exit 3; }
. $SITE/.k3/env.sh
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT"  # the lab's modules, after the bundle's site
cp -r "$ROOT/overlay/vllm/." $SITE/vllm/      # our overlay as in this checkout
echo "[kda] run $K3_RUN_ID, $TOTAL s in all, tune $TUNE_S s"

KDA_JSON="$OUT/tune_sm90_kda.json"
if [ "$TUNE_S" -gt 0 ]; then
  timeout -k 5 $((TUNE_S + 30)) python3 -m k3lab.tune --cache "$CACHE" \
    --seed-cache "$ROOT/results/tune_cache" --priors "$K3_TOOLS/k3/priors.json" \
    --out "$KDA_JSON" --deadline-s "$TUNE_S" --workers 14 --run-id "$K3_RUN_ID" \
    --shape 6144x7168 --shape 144x7168 --donor 6144x7168=6288x7168 --refine-rounds 1 --wait-s 0 \
    2>&1 | grep -v "^\[kernels\]" | tee "$OUT/tune.log"
  for d in "$CACHE"/*/; do [ -d "$d" ] && python3 -m k3lab.tune_cache pack "$CACHE" \
    "$(basename "$d")" "$OUT/tune_cache_kda/$(basename "$d").jsonl.gz"; done
else
  KDA_JSON="$R/tune_sm90_kda.json"  # TUNE_S 0: the committed KDA run's rows
fi
# The SM90 table as the repository renders it (docs/gpu-lab.md), with this run's KDA rows.
if [ -s "$KDA_JSON" ]; then
  (cd "$ROOT" && python3 -m k3lab.render_table results/sm90/decode_gemm_sm90.json \
     --add "results/sm90/tune_sm90.json@1536x128,3072x128,768x128" --add "$KDA_JSON" $SITE/$TABLE)
else
  echo "[kda] no tuner JSON: tests and benchmark use the committed table"
fi
echo "[kda] tuned and rendered at $(( $(date +%s) - START ))s"

mkdir -p /tmp/k3t/tests/kernels && cp "$ROOT"/overlay/tests/kernels/test_kimi_k3_*_gpu.py /tmp/k3t/tests/kernels/
# Tests and benchmark in one process: vLLM imports once and the CuTe configs compile once.
# The benchmark gets what is left of TOTAL_S; it rewrites its JSON after every M.
END=$(( START + TOTAL - 8 )); T=$(( END - $(date +%s) )); [ $T -ge 30 ] || T=30
cd /tmp/k3t && timeout -k 5 $T python3 - "$OUT" "$END" <<'PY' 2>&1 | tee "$OUT/gpu.log"
import sys
import time

import pytest

out, end = sys.argv[1], float(sys.argv[2])
common = ["-p", "no:cacheprovider", "-q", "-rs", "--tb=short"]
rc = pytest.main(common + [f"--junitxml={out}/pytest_kda.xml",
                           "tests/kernels/test_kimi_k3_kda_projection_gpu.py"])
rc2 = pytest.main(common + [f"--junitxml={out}/pytest_llg_kda_rows.xml",
                            "tests/kernels/test_kimi_k3_low_latency_gemm_gpu.py",
                            "-k", "6144x7168 or 144x7168 or platform or enable"])
print(f"[kda] pytest exit codes: kda file {int(rc)}, low-latency file (new rows) {int(rc2)}", flush=True)
from k3lab.bench import kda as benchmark

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
