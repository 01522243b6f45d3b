#!/usr/bin/env bash
# Build the GPU stage's targets add-on from this checkout, as the rebase job builds it:
#   bash ci/gpu_stage/build_addon.sh [DEST] [PART_MIB]
# DEST (default .dev/targets) gets:
#   trees/<ref>/{tree.tar.xz,meta.json}  python -m ci.rebase --gpu-export (the trees the job built)
#   rebase-cpu.json                      that job's report (no CPU tests: --no-tests)
#   parts/part-NNN/                      python -m ci.gpu_stage.addon, in
#                                        parts of PART_MIB MiB (default 25), for
#                                        ci/gpu_stage/offline.sh stash/run
# Refs: $REFS (default: the targets ci/targets.toml gives the GPU stage). The trees' commits depend only on the
# patch series and overlay, so re-run this whenever overlay/ or patches/ change: results
# measured on other trees are refused by --gpu-results. Exit 2: a ref was not exported or
# its tarball does not read back; rebase.py's own code when it failed other than with a
# verdict (3, 4, 5). A second build of the same DEST waits for the first.
set -uo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.dev/targets} PART_MIB=${2:-25} PY=${PYTHON:-.venv/bin/python}
REFS=${REFS:-$("$PY" -m ci.targets refs --gpu-stage)}
start=$(date +%s)
mkdir -p "$DEST"
# One build at a time per DEST (two writing the same tarballs corrupt them), into a fresh
# folder that replaces the last build's only once it is complete.
exec 9>"$DEST/.build.lock"
flock -n 9 || { echo "another build_addon.sh is writing $DEST; waiting" >&2; flock 9; }
NEW="$DEST/.new"
rm -rf "$NEW" && mkdir -p "$NEW"
onto=(); for r in $REFS; do onto+=(--onto "$r"); done
# Exit 3/4/5 (a patch or our module conflicts, or the tree fails verification) is the
# job's verdict, not a failure here: the tree is exported either way, with our module
# preferred where it conflicted.
"$PY" -m ci.rebase "${onto[@]}" --no-tests -q --json "$NEW/rebase-cpu.json" \
  --gpu-export "$NEW/trees" > "$NEW/rebase-cpu.log" 2>&1
rc=$?
echo "rebase.py exit $rc ($(( $(date +%s) - start )) s)"
# Any other code (bad input, no source, an environment, an interrupt): no trustworthy trees.
case $rc in 0|3|4|5) ;; *) echo "rebase.py failed, exit $rc (see $NEW/rebase-cpu.log)" >&2; exit "$rc" ;; esac
for r in $REFS; do
  [ -f "$NEW/trees/$r/meta.json" ] || { echo "no tree exported for $r (see $NEW/rebase-cpu.log)" >&2; exit 2; }
  xz -t "$NEW/trees/$r/tree.tar.xz" || { echo "$r: tree.tar.xz is corrupt" >&2; exit 2; }
done
"$PY" -m ci.gpu_stage.addon --target-trees "$NEW/trees" --part-mib "$PART_MIB" \
  --out "$NEW/parts" || exit $?
rm -rf "$DEST/trees" "$DEST/parts" "$DEST/rebase-cpu.json" "$DEST/rebase-cpu.log"
mv "$NEW"/* "$DEST"/ && rmdir "$NEW"
"$PY" - "$DEST" <<'PY'
import json, pathlib, sys
dest = pathlib.Path(sys.argv[1])
for ref in sorted(p.name for p in (dest / "trees").iterdir()):
    meta = json.loads((dest / "trees" / ref / "meta.json").read_text())
    print(f"{ref}: tree {meta['tree_sha'][:12]}, CuTe DSL {' '.join(meta['cute_dsl'])}, "
          f"our module {'preferred (merge conflicted)' if meta['prefer'] else 'as merged'}")
for part in sorted((dest / "parts").iterdir()):
    size = sum(f.stat().st_size for f in part.iterdir())
    print(f"{part}: {size / 2**20:.1f} MiB")
PY
echo "built in $(( $(date +%s) - start )) s"
