#!/usr/bin/env bash
# Steps of the GPU tier on a machine reached only through file transfers (our H200).
# Each step is one call, from the repository's root; see docs/gpu-lab.md. All outputs go
# to $OUT (or ./out); the tuner's cache comes back as one file per GPU.
#   stash PART_DIR       keep a bundle part in /root/stash for the next call
#   install PART_DIR     reassemble stash + PART_DIR, install into /tmp/site, smoke-import
#   tune SECONDS         resume the tuner until SECONDS after this step started
#   final                render the SM90 table, run the GPU tests, run the benchmark
#   tests                every GPU test file of the overlay (TEST_S seconds at most; TESTS: a subset)
#   replay STOCK_DIR     issues 21, 27: the decode-step replay of one deployment mode, stock vs the
#                        patched model (k3lab.decode_step.replay; REPLAY_ARGS: --mode NAME, more flags)
#   model_check PRISTINE issue 27: v0.28.0's own layers under the profiler, per deployment mode
#                        (k3lab.decode_step.model_check), on a copy of the site with PRISTINE's
#                        v0.28.0 model files put back (MODE_S seconds per mode, MS token counts,
#                        MODES the modes of modes.json, default "h200-default")
#   attn_res STOCK_DIR  issue 28: attn-res alone, v0.28.0's kernel against ours (k3lab.decode_step.attn_res_bench;
#                        AR_ARGS: --kinds, --m, --apply-best ...), on the overlay as committed now
#   decode SECONDS       issue 12: every backend on every shape x M (k3lab.bench.decode_gemm.runner:
#                        one child process per phase, each under deadlines), done within SECONDS
#                        (DECODE_ARGS: more flags of figures.py, e.g. --shape 3648x7168)
#   chain                issue 28: the table's GEMMs of <= 100 MB back to back in one CUDA graph, M 1..16, per
#                        table of CHAIN_TABLES ("NAME=PATH ...", default the overlay's as committed), with and
#                        without a norm before each (k3lab.bench.chain; CHAIN_ARGS: more flags)
#   skinny SECONDS       issue 28: skinny_pdl and gemv_pdl on every SM90 shape at M 1..4 (SKINNY_M; SKINNY_ARGS: more flags) against the
#                        table, CuTe and cuBLAS, alone and in the chain (k3lab.bench.skinny_pdl_sweep)
set -uo pipefail
START=$(date +%s)
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
SITE=/tmp/site CACHE=/root/k3cache HERE=$(cd "$(dirname "$0")" && pwd) ROOT=$(cd "$(dirname "$0")/../.." && pwd)
R=$ROOT/results/sm90  # the committed runs the steps start from
# The lab's commands, as modules of this repository (searched after the bundle's site).
lab() { PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT" python3 -m "$@"; }
# The tuner's cache as git keeps it: one file per GPU, for the next call or machine.
pack() { for d in "$CACHE"/*/; do [ -d "$d" ] && lab k3lab.tune_cache pack "$CACHE" "$(basename "$d")" "$OUT/tune_cache/$(basename "$d").jsonl.gz"; done; }
export PYTHONUNBUFFERED=1 K3_RUN_ID=${K3_RUN_ID:-h200-$(date +%Y%m%d)}
envs() { [ -f $SITE/.k3/env.sh ] || { echo "no $SITE: fresh machine, re-send the bundle" >&2; exit 3; }
         . $SITE/.k3/env.sh; [ -f /root/dsv3/k3_dsv3_fused_a.so ] && export K3_DSV3_LIB=/root/dsv3/k3_dsv3_fused_a.so; true; }
# vllm/platforms/cuda.py imports the compiled vllm._C_stable_libtorch at module level;
# the bundle ships no compiled vLLM (CuTe kernels need none), so give it an empty one.
shim() { [ -n "$(ls $SITE/vllm/_C_stable_libtorch*.so 2>/dev/null)" ] || cp "$HERE/no_compiled_vllm_shim.py" $SITE/vllm/_C_stable_libtorch.py; }
step=$1; shift
case $step in
stash)
  mkdir -p /root/stash && cp "$1"/* /root/stash/ && ls -la /root/stash ;;
tests)
  # Every GPU test file the overlay lays (numerics of every backend and fused kernel, PDL in
  # the PTX), on the installed tree with the overlay as committed now; TEST_S caps the run.
  envs; shim
  cp -r overlay/vllm/. $SITE/vllm/
  rm -rf /tmp/k3t && mkdir -p /tmp/k3t/tests/kernels && cp overlay/tests/kernels/*.py /tmp/k3t/tests/kernels/
  (cd /tmp/k3t && timeout ${TEST_S:-400} python3 -m pytest -p no:cacheprovider -q -rs --tb=short -o "markers=gpu: needs a CUDA GPU" \
     --junitxml="$OUT/pytest_gpu.xml" ${TESTS:-tests/kernels/*_gpu.py tests/kernels/test_kimi_k3_fused_ptx.py} \
     2>&1 | tail -n 60 | tee "$OUT/pytest_gpu.log") ;;
replay)
  # v0.28.0's own Triton ops come from STOCK_DIR (python -m k3lab.decode_step.imports extract);
  # the patched variant imports the installed tree with the overlay as committed now.
  envs; shim
  cp -r overlay/vllm/. $SITE/vllm/
  lab k3lab.decode_step.replay --stock-dir "$1" --out "$OUT" ${REPLAY_ARGS:-} 2>&1 \
     | grep -v "^\[kernels\]" | tee "$OUT/replay.log" ;;
attn_res)
  envs; shim
  cp -r overlay/vllm/. $SITE/vllm/
  lab k3lab.decode_step.attn_res_bench --stock-dir "$1" --out "$OUT" ${AR_ARGS:-} 2>&1 \
     | grep -v "^\[kernels\]" | tee "$OUT/attn_res_bench.log" | grep -v '^{"M"' ;;
model_check)
  # A copy of the site, so the patched tree stays for the steps after this one.
  envs; shim; rm -rf /tmp/site_v028 && cp -a $SITE /tmp/site_v028 && cp -r "$1/vllm/." /tmp/site_v028/vllm/
  export PYTHONPATH=${PYTHONPATH//$SITE/\/tmp\/site_v028}:$ROOT K3_VLLM_ROOT=/tmp/site_v028
  python3 -c "import importlib.util as u; print('vllm from', u.find_spec('vllm').origin)"
  for mode in ${MODES:-h200-default}; do  # one process per mode (v0.28.0 reads its environment at import)
    timeout ${MODE_S:-240} python3 -m k3lab.decode_step.model_check --mode $mode --m ${MS:-1,16} --out "$OUT" \
      > "$OUT/model_check_$mode.log" 2>&1 &
  done
  wait
  for mode in ${MODES:-h200-default}; do
    echo "== $mode"; grep -v "^\(INFO\|DEBUG\|WARNING\)" "$OUT/model_check_$mode.log" | tail -n 25
  done
  tar -czf "$OUT/traces.tgz" -C /tmp/k3_model_check . 2>/dev/null; ls -la "$OUT" | grep model_check ;;
install)
  bash "$HERE/install.sh" --target $SITE /root/stash "$1" > /tmp/env.sh || exit $?
  mv /tmp/env.sh $SITE/.k3/env.sh; cat $SITE/.k3/env.sh; envs
  shim
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 - <<'PY'
import time, torch
t = time.time()
from vllm.platforms import current_platform
from vllm.models.kimi_k3.nvidia import low_latency_gemm_dispatch as llg
print("torch", torch.__version__, "capability", current_platform.get_device_capability(),
      "table", getattr(llg.device_table(), "arch", None), f"import {time.time() - t:.0f}s")
PY
  ;;
tune)
  envs; shim; mkdir -p $CACHE
  # Resume from what the repo carries (a fresh machine) and what this machine kept.
  cp -n "$ROOT"/results/tune_cache/*.jsonl.gz $CACHE/ 2>/dev/null
  if [ ! -f /root/dsv3/.tried ] && [ -n "${K3_TRY_DSV3:-}" ]; then
    mkdir -p /root/dsv3 && touch /root/dsv3/.tried
    (python3 "$HERE/dsv3_build.py" --csrc $K3_TOOLS/k3/csrc --out /root/dsv3 > /root/dsv3/build.log 2>&1 &)
  fi
  left=$(( $1 - ($(date +%s) - START) ))
  lab k3lab.tune --cache $CACHE --priors $K3_TOOLS/k3/priors.json \
     --out "$OUT/tune_sm90.json" --deadline-s $left --run-id "$K3_RUN_ID" 2>&1 | tee "$OUT/tune.log" | grep -v "^\[kernels\]"
  pack
  cp /root/dsv3/build.log "$OUT/dsv3_build.log" 2>/dev/null; true ;;
dsv3)
  envs; shim; rm -rf /root/dsv3; mkdir -p /root/dsv3
  timeout ${1:-300} python3 "$HERE/dsv3_build.py" --csrc $K3_TOOLS/k3/csrc --out /root/dsv3 > /root/dsv3/build.log 2>&1
  echo "dsv3 build rc=$?"; grep -v "^\[" /root/dsv3/build.log | tail -n 30; cp /root/dsv3/build.log "$OUT/dsv3_build.log" ;;
final)
  envs; shim
  tail -n 25 /root/dsv3/build.log > "$OUT/dsv3_build.log" 2>/dev/null; ls -la /root/dsv3 2>/dev/null | head
  [ -n "${K3_DSV3_LIB:-}" ] && echo "dsv3 op: $K3_DSV3_LIB"
  cp -r overlay/vllm/. $SITE/vllm/        # the overlay as committed now (table included)
  python3 -c "import traceback
try:
    import vllm.models.kimi_k3.nvidia.low_latency_gemm_dispatch as m; print('overlay module imports; table', m.device_table().arch)
except Exception:
    traceback.print_exc()" 2>&1 | tail -n 25
  mkdir -p /tmp/k3t/tests/kernels && cp overlay/tests/kernels/test_kimi_k3_low_latency_gemm_gpu.py /tmp/k3t/tests/kernels/
  (cd /tmp/k3t && timeout ${TEST_S:-300} python3 -m pytest -p no:cacheprovider -q -rs --tb=short \
     --junitxml="$OUT/pytest_gpu.xml" tests/kernels/test_kimi_k3_low_latency_gemm_gpu.py 2>&1 | tail -n 40 | tee "$OUT/pytest_gpu.log")
  [ -n "${SKIP_BENCH:-}" ] || lab k3lab.bench.gemm --ours overlay/vllm/models/kimi_k3/nvidia/low_latency_gemm_sm90.py \
     --v029 $K3_TOOLS/k3/priors.json --tune "$R/tune_sm90.json" \
     --json "$OUT/bench_sm90.json" --md "$OUT/bench_sm90.md" 2>&1 | tee "$OUT/bench.log" | tail -n 30 ;;
decode)
  envs; shim
  cp -r overlay/vllm/. $SITE/vllm/        # the overlay as committed now (our kernel included)
  # FlashInfer (tinygemm) from carried wheels into a folder of its own, searched after
  # the bundle's (pip --target --upgrade would replace the bundle's bin/ wholesale).
  FI=${K3_FI_WHEELS:-.dev/kernel/fi}
  if ls "$FI"/*.whl >/dev/null 2>&1; then
    rm -rf /tmp/fi
    timeout 90 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/fi "$FI"/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/fi PATH=$PATH:/tmp/fi/bin
  fi
  left=$(( ${1:-370} - ($(date +%s) - START) ))
  lab k3lab.bench.decode_gemm.runner --out-dir "$OUT" --deadline-s $left -- \
     --sweep $R/swap_ab_sweep_sm90.json --tune $R/tune_sm90.json --tune $R/tune_sm90_kda.json \
     --cute-budget-s ${K3_CUTE_BUDGET_S:-60} \
     --table overlay/vllm/models/kimi_k3/nvidia/low_latency_gemm_sm90.py ${DECODE_ARGS:-} 2>&1 \
     | tee "$OUT/figures.log" | grep -v "^\[kernels\]\|^\[candidates\]\|%\]$"
  PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT" timeout 30 python3 -m k3lab.bench.decode_gemm.plot "$OUT/decode_gemm_sm90.json" "$OUT/decode_gemm_sm90.png" ;;
chain)
  envs; shim
  cp -r overlay/vllm/. $SITE/vllm/        # the overlay as committed now (its table is "now" by default)
  tables=""; for t in ${CHAIN_TABLES:-now=overlay/vllm/models/kimi_k3/nvidia/low_latency_gemm_sm90.py}; do
    tables="$tables --table $t"; done
  lab k3lab.bench.chain $tables --out "$OUT" ${CHAIN_ARGS:-} 2>&1 | grep -v "^\[kernels\]" | tee "$OUT/chain.log" ;;
skinny)
  envs; shim
  cp -r overlay/vllm/. $SITE/vllm/        # the overlay as committed now (skinny_pdl, gemv_pdl included)
  # Stop timing new shapes alone 40 s before SECONDS: the chain and the JSON come after.
  lab k3lab.bench.skinny_pdl_sweep --out "$OUT" --figures $R/decode_gemm_sm90.json \
     --m ${SKINNY_M:-1,2,3,4} --budget-s $(( ${1:-240} - 40 )) ${SKINNY_ARGS:-} 2>&1 \
     | grep -v "^\[kernels\]\|^\[candidates\]" | tee "$OUT/skinny_pdl_sweep.log" ;;
esac
echo "[device_run] $step done in $(( $(date +%s) - START ))s"
