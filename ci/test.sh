#!/usr/bin/env bash
# The project's tests, from nothing: a venv in .venv, this package, torch 2.13.0 (CPU)
# and vLLM v0.28.0's own requirements (for its skinny-GEMM test file, run on the patched
# tree), then one pytest run over tests/ (synthetic, e2e on real releases, CPU tier).
# Downloads are cached under ~/.cache/vllm-k3-overlay (release mirror) and pip's cache.
# Each step says what it does when it starts (pip's downloads with their sizes as they
# come) and how long it took; arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

begin() { echo "ci/test.sh: $* …"; started=$SECONDS; }
done_() { echo "ci/test.sh:   done in $((SECONDS - started)) s"; }

# pip, saying only what a log reader needs: each file it downloads (with its size) and
# what it installs; everything it printed is shown if it fails.
pip_install() {
    local log
    log=$(mktemp "${TMPDIR:-/tmp}/k3-pip.XXXXXX")
    # one unbuffered sed picks, indents and clips the lines (grep | cut held them: cut buffers)
    if ! "$PY" -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 | tee "$log" \
            | sed -u -n -E '/^ *(Downloading|Installing collected packages)/{s/^ */  /;s/^(.{240}).*/\1/;p}'; then
        tail -n 30 "$log" >&2
        rm -f "$log"
        return 1
    fi
    rm -f "$log"
}

[ -x .venv/bin/python ] || { begin "creating .venv"; python3 -m venv .venv; done_; }
PY=.venv/bin/python
begin "installing this package, its test dependencies and torch 2.13.0 (first time: torch is" \
      "the big download)"
pip_install -e '.[test]' 'torch==2.13.0'
done_

# The workflow linters (tests/test_workflows.py runs them): each installed on its own, so
# one that cannot be installed costs only
# its test, which then skips naming this log.
begin "installing the workflow linters (pyproject.toml's lint extra)"
: > .venv/lint-install.log
lint='import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["lint"])'
for req in $($PY -c "$lint"); do
    if ! "$PY" -m pip install -q --disable-pip-version-check "$req" >> .venv/lint-install.log 2>&1; then
        echo "ci/test.sh:   $req could not be installed (.venv/lint-install.log); its test will skip"
    fi
done
done_

# The patched pinned base: its requirements/common.txt is what vLLM's tests import.
begin "applying the series onto the pinned base (apply.py --check; first time: the ~40 MB sdist)"
$PY apply.py --check >/dev/null  # fails loudly here if the base cannot be fetched or patched
done_
mirror=$($PY -c 'from k3overlay.source import default_mirror; print(default_mirror().path)')
base=$($PY -c 'import json; print(json.load(open("overlay.json"))["base"])')
git --git-dir="$mirror" show "$base:requirements/common.txt" > .venv/vllm-common.txt
begin "installing vLLM $base's requirements/common.txt, pytest and tblib"
pip_install -r .venv/vllm-common.txt pytest tblib
done_

export K3_CPU_TIER=required  # here a missing vLLM dependency is a failure, not a skip
# With no arguments (README command 2): the failing tests by name, the skip reasons and the
# slowest tests listed at the end (-rfEs: -r alone would replace pytest's default -rfE).
[ $# -gt 0 ] || set -- -rfEs --durations=10
echo "ci/test.sh: pytest $* (each e2e test says when it starts and how long it took)"
exec $PY -m pytest "$@"
