#!/usr/bin/env bash
# Issue 27: v0.28.0's own Kimi-K3 layers under the profiler, both capture modes, one call.
#   bash k3lab/device/model_check.sh STAGE
# STAGE holds: part-NNN/ (the bundle parts not stashed; the rest is in /root/stash from
# `run.sh stash`), k3lab/ (this lab, with decode_step/model_check.py) and pristine/vllm/ (the
# v0.28.0 files the patch series modifies, put back over the bundle's patched tree).
# Writes $OUT/model_check_<mode>.json and the logs; run from STAGE so its k3lab is imported.
set -uo pipefail
ST=$(cd "$1" && pwd); OUT=${OUT:-$ST/out}; mkdir -p "$OUT"; START=$(date +%s)
SITE=/tmp/site
bash "$ST/k3lab/device/install.sh" --target $SITE /root/stash "$ST"/part-* > /tmp/env.sh || exit $?
. /tmp/env.sh
ls $SITE/vllm/_C_stable_libtorch*.so >/dev/null 2>&1 || cp "$ST/k3lab/device/no_compiled_vllm_shim.py" $SITE/vllm/_C_stable_libtorch.py
cp -r "$ST/pristine/vllm/." $SITE/vllm/      # v0.28.0's own model files, not the patched ones
echo "[model_check] installed in $(( $(date +%s) - START ))s"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
cd "$ST" || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PYTHONPATH:$ST
for mode in breakable full; do   # one process per mode, both at once (independent, one GPU)
  timeout ${MODE_S:-300} python3 -m k3lab.decode_step.model_check --mode $mode --m ${MS:-1,16} --out "$OUT" \
    > "$OUT/model_check_$mode.log" 2>&1 &
done
wait
for mode in breakable full; do
  echo "== $mode"; grep -v "^\(INFO\|DEBUG\|WARNING\)" "$OUT/model_check_$mode.log" | tail -n 25
done
tar -czf "$OUT/traces.tgz" -C /tmp/k3_model_check . 2>/dev/null; ls -la "$OUT"
echo "[model_check] done in $(( $(date +%s) - START ))s"
