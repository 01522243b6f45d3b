#!/usr/bin/env bash
# The rebase job's GPU stage on an air-gapped GPU runner (our H200), from the offline
# bundles: the base bundle installed into $SITE first (k3lab/device/run.sh install),
# then the targets add-on (ci/gpu_stage/build_addon.sh) in parts:
#   stash PART_DIR...   keep add-on parts in $STASH for a later call
#   run [PART_DIR...]   install the add-on (stash + these), then every target's GPU tests
#                       side by side, then every target's A/B under one GPU lock
# Deadlines, in seconds after `run` starts: TESTS_END (default 300) for the tests, AB_END
# (450) for the A/B; a phase ends when its work is done or at its deadline, whatever is
# first, and what it measured is in the JSON either way (a cut suite counts the tests that
# ran, the A/B keeps every row timed). Per target: OURS_WORKERS (5) pytest shards for our
# files (one kernel config's tests in one shard), VLLM_WORKERS (2) for vLLM's file,
# AB_WORKERS (4) A/B processes (they compile in parallel, time one at a time).
# Results in $OUT: <ref>.json (python -m ci.rebase --gpu-results $OUT attaches them), stage.log,
# logs.tgz (each target's pytest output and per-test records, <ref>.<suite>.jsonl).
# FI_WHEELS: a folder of FlashInfer's wheels (tinygemm), installed into /tmp/fi, searched last.
# SITE (/tmp/site), STASH (/root/stash-targets) and PYTHON (python3) can be set, e.g. to
# try the plumbing on a machine without a GPU (the tests then skip, the A/B says why not).
set -uo pipefail
START=$(date +%s)
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
SITE=${SITE:-/tmp/site} STASH=${STASH:-/root/stash-targets} PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd) ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# run.py and summary.py are modules of this repository (ci.gpu_stage), found through ROOT.
MOD=(env "PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m)
TESTS_END=${TESTS_END:-300} AB_END=${AB_END:-450}
OURS_WORKERS=${OURS_WORKERS:-5} VLLM_WORKERS=${VLLM_WORKERS:-2} AB_WORKERS=${AB_WORKERS:-4}
export PYTHONUNBUFFERED=1
left() { local s=$(( $1 - ($(date +%s) - START) )); echo $(( s > 1 ? s : 1 )); }
say() { echo "[offline +$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/stage.log"; }
step=${1:-}; shift || true
case $step in
stash)
  mkdir -p "$STASH" && for d in "$@"; do cp "$d"/* "$STASH"/; done
  ls -la "$STASH"; test -f "$SITE/.k3/env.sh" && echo "base bundle: installed" || echo "base bundle: absent" ;;
run)
  test -f "$SITE/.k3/env.sh" || { echo "no base bundle in $SITE: install it first" >&2; exit 3; }
  PYTHON=$PY bash "$ROOT/k3lab/device/install.sh" --target "$SITE" "$STASH" "$@" 2>&1 | tee -a "$OUT/stage.log"
  [ "${PIPESTATUS[0]}" = 0 ] || exit 3
  nproc | sed 's/^/cores: /' >> "$OUT/stage.log"
  # FlashInfer (our tinygemm rows) from wheels in $FI_WHEELS, into a folder of its own that
  # is searched last (as k3lab/device/run.sh decode does); its JIT needs ninja on PATH.
  last=()
  if [ -n "${FI_WHEELS:-}" ] && ls "$FI_WHEELS"/*.whl >/dev/null 2>&1; then
    rm -rf /tmp/fi && timeout 90 "$PY" -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --target /tmp/fi "$FI_WHEELS"/*.whl && last=(--site /tmp/fi) \
      && export PATH=$PATH:/tmp/fi/bin
    say "FlashInfer: ${last[*]:-not installed}"
  fi
  for phase in tests ab; do
    end=$([ $phase = tests ] && echo "$TESTS_END" || echo "$AB_END")
    say "$phase: until +${end}s"
    for t in "$SITE"/.k3/targets/*/; do
      ref=$(basename "$t") sites=()
      [ -d "$t/site" ] && sites+=(--site "$t/site")
      # run.py keeps its own deadline; `timeout` is the backstop should it hang past it.
      timeout -k 5 $(( $(left "$end") + 30 )) "${MOD[@]}" ci.gpu_stage.run $phase --tree "$t/tree" \
        --meta "$t/meta.json" --out "$OUT/$ref.json" "${sites[@]}" --site "$SITE" "${last[@]}" \
        --lock /tmp/k3-gpu.lock --deadline-s "$(left "$end")" --vllm-workers "$VLLM_WORKERS" \
        --workers $([ $phase = tests ] && echo "$OURS_WORKERS" || echo "$AB_WORKERS") \
        >> "$OUT/$ref.log" 2>&1 &
    done
    wait; say "$phase done"
  done
  "${MOD[@]}" ci.gpu_stage.summary "$OUT"/*.json | tee -a "$OUT/stage.log"
  (cd "$OUT" && ls -- *.log *.jsonl 2>/dev/null | grep -vx stage.log | tar -czf logs.tgz \
     --remove-files -T -)
  say "run done" ;;
*)
  echo "usage: $0 stash PART_DIR... | run [PART_DIR...]" >&2; exit 2 ;;
esac
