#!/usr/bin/env bash
# Reassemble the offline GPU bundle and install it into a target folder.
#
#   bash k3lab/device/install.sh --target DIR PART_DIR [PART_DIR ...]
#
# PART_DIRs hold bundle.partNNN files (any split across folders) and BUNDLE.json.
# Checks every part's and the payload's sha256, installs the wheels with
# `pip install --no-index --no-deps --target DIR`, unpacks the patched vllm/ tree
# (with its dist-info, plus no_compiled_vllm_shim.py where no compiled vLLM exists)
# into DIR and our tools into DIR/.k3, then prints the
# `export` lines to eval. Exit 2: a part is missing or corrupt; 3: pip failed.
# A targets add-on (BUNDLE.json "kind": "targets", bundle.py --only-targets) installs only
# DIR/.k3/targets/<ref>/: tree/ (the rebase job's tree, with its dist-info and the shim)
# and site/ (the target's own wheels), on top of a base bundle installed into DIR before.
set -euo pipefail
target=""
dirs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --target) target="$2"; shift 2 ;;
    *) dirs+=("$1"); shift ;;
  esac
done
[ -n "$target" ] && [ ${#dirs[@]} -gt 0 ] || { echo "usage: $0 --target DIR PART_DIR..." >&2; exit 1; }
py=${PYTHON:-python3}
manifest=""
for d in "${dirs[@]}"; do [ -f "$d/BUNDLE.json" ] && manifest="$d/BUNDLE.json"; done
[ -n "$manifest" ] || { echo "no BUNDLE.json in ${dirs[*]}" >&2; exit 2; }
mkdir -p "$target/.k3"
payload="$target/.k3/payload.tar"
# Concatenate parts in manifest order, verifying each (the manifest is the truth).
"$py" - "$manifest" "$payload" "${dirs[@]}" <<'PY' || exit 2
import hashlib, json, os, sys
manifest, payload, dirs = sys.argv[1], sys.argv[2], sys.argv[3:]
m = json.load(open(manifest))
with open(payload, "wb") as out:
    for part in m["parts"]:
        found = [os.path.join(d, part["name"]) for d in dirs if os.path.exists(os.path.join(d, part["name"]))]
        if not found:
            sys.exit(f"missing {part['name']}")
        data = open(found[0], "rb").read()
        if hashlib.sha256(data).hexdigest() != part["sha256"]:
            sys.exit(f"corrupt {found[0]}")
        out.write(data)
h = hashlib.sha256(open(payload, "rb").read()).hexdigest()
if h != m["payload_sha256"]:
    sys.exit("payload sha256 mismatch")
print(f"bundle ok: {len(m['parts'])} parts, {m['payload_bytes']} bytes, {m.get('kind', 'base')}", file=sys.stderr)
PY
tar -xf "$payload" -C "$target/.k3"
rm -f "$payload"
if [ "$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("kind", "base"))' "$manifest")" = targets ]; then
  shim="$target/.k3/k3/k3lab/device/no_compiled_vllm_shim.py"  # from the base bundle
  for t in "$target"/.k3/targets/*/; do
    mkdir -p "$t/tree" && tar -xJf "$t/tree.tar.xz" -C "$t/tree" && rm -f "$t/tree.tar.xz"
    ls "$t"/tree/vllm/_C_stable_libtorch*.so >/dev/null 2>&1 || cp "$shim" "$t/tree/vllm/_C_stable_libtorch.py"
    if ls "$t"/wheels/*.whl >/dev/null 2>&1; then
      "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$t/site" "$t"/wheels/*.whl >&2 || exit 3
    fi
    echo "target $(basename "$t"): $t" >&2
  done
  exit 0
fi
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$target" "$target"/.k3/wheels/*.whl >&2 || exit 3
tar -xJf "$target/.k3/vllm_tree.tar.xz" -C "$target"
# The tree carries no compiled vLLM; its CUDA platform imports one at import time.
ls "$target"/vllm/_C_stable_libtorch*.so >/dev/null 2>&1 ||
  cp "$target/.k3/k3/k3lab/device/no_compiled_vllm_shim.py" "$target/vllm/_C_stable_libtorch.py"
# Under --target the cutlass wheel's .pth is not processed: add its path by hand.
echo "export PYTHONPATH=$target:$target/nvidia_cutlass_dsl/dsl_packages\${PYTHONPATH:+:\$PYTHONPATH}"
echo "export K3_VLLM_ROOT=$target K3_TOOLS=$target/.k3"
