#!/usr/bin/env bash
# The KDA steps of the GPU tier as one call, on a machine where `device_run.sh install`
# has run (ci/gpu/README.md): tune the two KDA row views with ci/gpu/tune.py, render the
# SM90 table with them, run the GPU tests (the KDA file, and the low-latency file's cases
# for the new rows), then the KDA benchmark. Outputs in $OUT: tune_sm90_kda.json,
# tune_cache.tgz, tune.log, gpu.log, pytest_kda.xml, kda_bench_sm90.json/.md.
#   bash ci/gpu/kda/device.sh [TUNE_SECONDS] [BENCH_SECONDS]
set -uo pipefail
START=$(date +%s)
KDA=$(cd "$(dirname "$0")" && pwd); GPU=$(dirname "$KDA"); ROOT=$(cd "$GPU/../.." && pwd)
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
SITE=/tmp/site CACHE=/root/k3cache
export PYTHONUNBUFFERED=1 K3_RUN_ID=${K3_RUN_ID:-h200-$(date +%Y%m%d)-kda}
[ -f $SITE/.k3/env.sh ] || { echo "no $SITE: run device_run.sh install first" >&2; exit 3; }
. $SITE/.k3/env.sh
cp -r "$ROOT/overlay/vllm/." $SITE/vllm/      # our overlay as in this checkout
mkdir -p $CACHE && cp -rn "$GPU/results/tune_cache/." $CACHE/
python3 "$GPU/tune.py" --cache $CACHE --priors "$K3_TOOLS/k3/priors.json" --out "$OUT/tune_sm90_kda.json" \
  --deadline-s "${1:-110}" --workers 14 --run-id "$K3_RUN_ID" --shape 6144x7168 --shape 144x7168 2>&1 \
  | grep -v "^\[kernels\]" | tee "$OUT/tune.log"
tar -czf "$OUT/tune_cache.tgz" -C $CACHE .
(cd "$ROOT" && python3 ci/gpu/render_table.py ci/gpu/results/tune_sm90.json --add "$OUT/tune_sm90_kda.json" \
  $SITE/vllm/models/kimi_k3/nvidia/low_latency_gemm_sm90.py) || exit 4
echo "[kda] tuned and rendered at $(( $(date +%s) - START ))s"
mkdir -p /tmp/k3t/tests/kernels && cp "$ROOT"/overlay/tests/kernels/test_kimi_k3_*_gpu.py /tmp/k3t/tests/kernels/
# Tests and benchmark in one process: vLLM imports once and the CuTe configs compile once.
cd /tmp/k3t && python3 - "$KDA" "$OUT" "${2:-120}" <<'PY' 2>&1 | tee "$OUT/gpu.log"
import sys
import pytest
kda, out, bench_s = sys.argv[1:4]
common = ["-p", "no:cacheprovider", "-q", "-rs", "--tb=short"]
rc = pytest.main(common + [f"--junitxml={out}/pytest_kda.xml",
                           "tests/kernels/test_kimi_k3_kda_projection_gpu.py"])
rc2 = pytest.main(common + [f"--junitxml={out}/pytest_llg_kda_rows.xml",
                            "tests/kernels/test_kimi_k3_low_latency_gemm_gpu.py",
                            "-k", "6144x7168 or 144x7168 or platform or enable"])
print(f"[kda] pytest exit codes: kda file {int(rc)}, low-latency file (new rows) {int(rc2)}", flush=True)
sys.path.insert(0, kda)
import benchmark
benchmark.main(["--json", f"{out}/kda_bench_sm90.json", "--md", f"{out}/kda_bench_sm90.md",
            "--deadline-s", bench_s])
PY
echo "[kda] done in $(( $(date +%s) - START ))s"
