#!/usr/bin/env bash
# The project's tests, from nothing: a venv in .venv, this package, torch 2.13.0 (CPU)
# and vLLM v0.28.0's own requirements (for its skinny-GEMM test file, run on the patched
# tree), then one pytest run over tests/ (synthetic, e2e on real releases, CPU tier).
# Downloads are cached under ~/.cache/vllm-k3-overlay (release mirror) and pip's cache.
set -euo pipefail
cd "$(dirname "$0")/.."

[ -x .venv/bin/python ] || python3 -m venv .venv
PY=.venv/bin/python
$PY -m pip install -q --disable-pip-version-check -e '.[test]' 'torch==2.13.0'

# The patched pinned base: its requirements/common.txt is what vLLM's tests import.
$PY apply.py -q --check >/dev/null  # fails loudly here if the base cannot be fetched or patched
mirror=$($PY -c 'from k3overlay.source import default_mirror; print(default_mirror().path)')
base=$($PY -c 'import json; print(json.load(open("overlay.json"))["base"])')
git --git-dir="$mirror" show "$base:requirements/common.txt" > .venv/vllm-common.txt
$PY -m pip install -q --disable-pip-version-check -r .venv/vllm-common.txt pytest tblib

export K3_CPU_TIER=required  # here a missing vLLM dependency is a failure, not a skip
exec $PY -m pytest "$@"
