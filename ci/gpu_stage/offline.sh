#!/usr/bin/env bash
# The rebase job's GPU stage on an air-gapped GPU runner (our H200), from the offline
# bundles: the base bundle installed into /tmp/site first (ci/gpu/device_run.sh install),
# then the targets add-on (ci/gpu/bundle.py --only-targets) in parts:
#   stash PART_DIR...        keep add-on parts in /root/stash-targets for a later call
#   run [PART_DIR...]        install the add-on (stash + these), then every target's GPU
#                            tests side by side, then every target's A/B under one GPU lock
# Budgets (seconds): TEST_S per test suite, AB_S for the A/B; WORKERS per pytest run
# (xdist), AB_WORKERS per target's A/B (they compile in parallel, time one at a time).
# Results in $OUT: <ref>.json (ci/rebase.py --gpu-results $OUT attaches them), <ref>.log.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
SITE=/tmp/site STASH=/root/stash-targets HERE=$(cd "$(dirname "$0")" && pwd)
TEST_S=${TEST_S:-150} AB_S=${AB_S:-90} WORKERS=${WORKERS:-3} AB_WORKERS=${AB_WORKERS:-4}
export PYTHONUNBUFFERED=1
step=$1; shift
case $step in
stash)
  mkdir -p $STASH && for d in "$@"; do cp "$d"/* $STASH/; done
  ls -la $STASH; test -f $SITE/.k3/env.sh && echo "base bundle: installed" || echo "base bundle: absent" ;;
run)
  test -f $SITE/.k3/env.sh || { echo "no base bundle in $SITE: install it first" >&2; exit 3; }
  bash "$HERE/../gpu/install.sh" --target $SITE $STASH "$@" || exit $?
  start=$(date +%s)
  for phase in tests ab; do
    for t in $SITE/.k3/targets/*/; do
      ref=$(basename "$t") sites=()
      [ -d "$t/site" ] && sites+=(--site "$t/site")
      python3 "$HERE/run.py" $phase --tree "$t/tree" --meta "$t/meta.json" --out "$OUT/$ref.json" \
        "${sites[@]}" --site $SITE --lock /tmp/k3-gpu.lock \
        --workers $([ $phase = tests ] && echo $WORKERS || echo $AB_WORKERS) \
        --deadline-s $([ $phase = tests ] && echo $TEST_S || echo $AB_S) >> "$OUT/$ref.log" 2>&1 &
    done
    wait; echo "[offline] $phase done at +$(( $(date +%s) - start ))s"
  done
  python3 - "$OUT" <<'PY'
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(p.read_text()); g = d.get("gpu", {}); a = d.get("ab", {})
    print(d["ref"], "gpu", {k: g.get(k) for k in ("passed", "failed", "skipped", "errors", "env_errors")},
          {k: {x: v.get(x) for x in ("passed", "failed", "skipped", "errors", "note")} for k, v in g.get("suites", {}).items()},
          g.get("env"))
    print("   ab", a.get("error") or {k: a.get("summary", {}).get(k) for k in
          ("rows", "measured", "geomean_ours", "geomean_upstream", "geomean_ours_over_upstream", "wins", "errors")})
PY
  ;;
esac
