"""ci/prefer_overlay.py: our Kimi-K3 modules win the import over the tree's, subpackages too."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

CI_DIR = Path(__file__).resolve().parent.parent
PKG = ("vllm", "models", "kimi_k3", "nvidia")


def _write(root: Path, rel: str, who: str) -> None:
    path = root.joinpath(*rel.split("/"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"WHO = {who!r}\n")


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    tree, ours = tmp_path / "tree", tmp_path / "ours"
    for i in range(len(PKG)):
        _write(tree, "/".join(PKG[: i + 1]) + "/__init__.py", "tree")
    nv = "/".join(PKG)
    for rel in ("dispatch.py", "only_theirs.py", "gemm_backends/__init__.py",
                "gemm_backends/swap_ab.py", "gemm_backends/theirs_backend.py"):  # fmt: skip
        _write(tree, f"{nv}/{rel}", "tree")
    for rel in (
        "dispatch.py",
        "gemm_backends/__init__.py",
        "gemm_backends/swap_ab.py",
        "gemm_backends/ours_only.py",
    ):
        _write(ours, rel, "ours")
    return tree, ours


def _who(tree: Path, ours: Path, names: list[str], install_after: str | None = None) -> str:
    code = textwrap.dedent(f"""
        import importlib, sys
        sys.path[:0] = [{str(tree)!r}, {str(CI_DIR)!r}]
        import prefer_overlay
        if {install_after!r}:
            importlib.import_module({install_after!r})
        try:
            prefer_overlay.install({str(ours)!r})
        except RuntimeError as e:
            print("refused:", e); raise SystemExit(0)
        base = "vllm.models.kimi_k3.nvidia."
        print(" ".join(importlib.import_module(base + n).WHO for n in {names!r}))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return run.stdout.strip()


def test_ours_wins_in_the_package_and_its_subpackage_and_the_rest_is_the_trees(tmp_path) -> None:
    tree, ours = _tree(tmp_path)
    names = ["dispatch", "only_theirs", "gemm_backends", "gemm_backends.swap_ab",
             "gemm_backends.ours_only", "gemm_backends.theirs_backend"]  # fmt: skip
    assert _who(tree, ours, names) == "ours tree ours ours ours tree"


def test_installing_after_the_package_was_imported_is_refused(tmp_path) -> None:
    tree, ours = _tree(tmp_path)
    out = _who(tree, ours, ["dispatch"], install_after="vllm.models.kimi_k3.nvidia.dispatch")
    assert out.startswith("refused: vllm.models.kimi_k3.nvidia.dispatch")


def test_names_that_are_no_module_names_find_nothing_of_ours(tmp_path) -> None:
    # An empty part or a path-like one: importlib.util.find_spec asks the finder with it;
    # ours must not turn it into a file (not even one outside the overlay folder).
    tree, ours = _tree(tmp_path)
    (tmp_path / "evil.py").write_text("WHO = 'evil'\n")
    code = textwrap.dedent(f"""
        import importlib, sys
        sys.path[:0] = [{str(tree)!r}, {str(CI_DIR)!r}]
        import prefer_overlay
        prefer_overlay.install({str(ours)!r})
        finder = sys.meta_path[0]
        base = "vllm.models.kimi_k3.nvidia"
        for name in (base + ".", base + "..dispatch", base + ".gemm_backends..swap_ab",
                     base + "." + {str(tmp_path / "evil")!r}):
            print(finder.find_spec(name) is None)
        print(finder.find_spec(base + ".dispatch") is not None)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["True"] * 5
