"""Import our overlay kernels and vLLM v0.28.0's own Triton ops without a vLLM install.

The replay runs where there is torch and Triton but no vLLM (the lent H200). Two kinds
of module are needed:

* ours, ``overlay/vllm/models/kimi_k3/nvidia/{swap_ab_gemm,fused_gemm,norm}.py``: they
  import only ``vllm.triton_utils`` and each other, so a stand-in ``vllm`` package whose
  ``models.kimi_k3.nvidia`` path is the overlay folder imports them unchanged;
* v0.28.0's Triton ops that the stock path runs on SM90 (``attn_res``,
  ``fused_q_kv_rmsnorm``, ``fused_mtp_input``): their source is read from the release
  (never copied into this repository) by :func:`extract_stock` into a git-ignored
  folder that travels with the device call, and loaded with stand-ins for the two
  names they import beyond Triton: ``vllm._custom_ops`` (only used for an SM100 op)
  and ``vllm.platforms.current_platform`` (PDL from SM90 on; no SM100 family).

``python -m k3lab.decode_step.imports extract DEST [--mirror GIT_DIR | --tree VLLM_TREE]``
writes the three v0.28.0 files to DEST (a ``--tree`` with git is read at v0.28.0, never its
patched files; one without must be v0.28.0's unpacked sdist); ``... pristine DEST`` writes v0.28.0's own copy of
every file the patch series modifies (DEST/vllm/..., for ``k3lab/device/run.sh model_check``);
``... stub DEST`` writes the stand-in package
(DEST/vllm) for tools such as pytest that import ``vllm.models.kimi_k3.nvidia.*``.
Exit codes: 0 done, 2 bad usage or a source that lacks a file.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import subprocess
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parents[2]
OVERLAY_PKG = ROOT / "overlay" / "vllm" / "models" / "kimi_k3" / "nvidia"
REF = "v0.28.0"
# name in DEST -> path in the vLLM release
STOCK_FILES = {
    "attn_res.py": "vllm/models/kimi_k3/nvidia/ops/attn_res.py",
    "fused_qk_rmsnorm.py": "vllm/models/common/ops/fused_qk_rmsnorm.py",
    "common_mtp.py": "vllm/models/kimi_k3/common/mtp.py",
}
DEFAULT_MIRROR = pathlib.Path.home() / ".cache" / "vllm-k3-overlay" / "mirror-v2.git"


class _Platform:
    """The two questions v0.28.0's Triton ops ask of ``current_platform``, on CUDA."""

    @staticmethod
    def is_arch_support_pdl() -> bool:
        import torch

        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9

    @staticmethod
    def is_device_capability_family(family: int) -> bool:
        import torch

        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] * 10 == family

    @staticmethod
    def is_cuda_alike() -> bool:
        return True


def _module(name: str, path: list[str] | None = None) -> types.ModuleType:
    mod = sys.modules.get(name)
    if mod is None:
        mod = types.ModuleType(name)
        if path is not None:
            mod.__path__ = path
        sys.modules[name] = mod
    return mod


def install_stand_ins() -> None:
    """Make ``vllm.models.kimi_k3.nvidia.*`` resolve to the overlay folder when vLLM is absent."""
    try:
        import vllm  # noqa: F401

        return  # a real vLLM tree: use it
    except ImportError:
        pass
    import triton
    import triton.language as tl

    _module("vllm", [])
    tu = _module("vllm.triton_utils")
    # HAS_TRITON: what vLLM's triton_utils says when Triton imports (fused_gemm reads it).
    tu.tl, tu.triton, tu.HAS_TRITON = tl, triton, True
    _module("vllm._custom_ops")
    _module("vllm.platforms").current_platform = _Platform()
    _module("vllm.models", [])
    _module("vllm.models.kimi_k3", [])
    _module("vllm.models.kimi_k3.nvidia", [str(OVERLAY_PKG)])


def overlay(name: str) -> types.ModuleType:
    """Our overlay module ``vllm.models.kimi_k3.nvidia.<name>``."""
    install_stand_ins()
    return importlib.import_module(f"vllm.models.kimi_k3.nvidia.{name}")


def stock(folder: pathlib.Path, name: str) -> types.ModuleType:
    """A v0.28.0 Triton op file written by :func:`extract_stock` (``name`` without .py)."""
    install_stand_ins()
    path = pathlib.Path(folder) / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: run `python -m k3lab.decode_step.imports extract` first")
    spec = importlib.util.spec_from_file_location(f"k3lab_v028_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def extract_stock(dest: pathlib.Path, mirror: pathlib.Path | None, tree: pathlib.Path | None) -> None:
    """Write v0.28.0's three Triton op files to ``dest`` from a release mirror or a tree."""
    _write_release_files(dest, STOCK_FILES, mirror, tree)


def patched_paths(series: pathlib.Path = ROOT / "patches") -> list[str]:
    """The vLLM files the patch series modifies (from its ``diff --git`` lines), sorted."""
    paths = set()
    for patch in series.glob("*.patch"):
        for line in patch.read_text().splitlines():
            if line.startswith("diff --git a/"):
                paths.add(line.split()[2][2:])
    return sorted(paths)


def extract_pristine(dest: pathlib.Path, mirror: pathlib.Path | None, tree: pathlib.Path | None) -> None:
    """Write v0.28.0's own copy of every file the series modifies under ``dest`` (their release
    paths), to be laid over the GPU bundle's patched tree for the model check."""
    _write_release_files(dest, {p: p for p in patched_paths()}, mirror, tree)


def _write_release_files(dest: pathlib.Path, files: dict[str, str], mirror, tree) -> None:
    """``files``: path under ``dest`` -> path in the v0.28.0 release (a tree, else the mirror)."""
    read = _release_reader(mirror, tree)
    for out, src in files.items():
        text = read(src)
        (dest / out).parent.mkdir(parents=True, exist_ok=True)
        (dest / out).write_text(text)


def _release_reader(mirror: pathlib.Path | None, tree: pathlib.Path | None):
    """How to read a path of the v0.28.0 release. A git tree is read at ``REF``, never its
    files: README command 1's ``work/vllm`` is a v0.28.0 checkout whose files are patched,
    and the model check would then check the patched model against itself. A tree without
    git must be the release's unpacked sdist (its ``PKG-INFO`` says the version). Raises
    OSError for a tree that is neither."""
    if tree is None:
        return lambda src: _git_show(["--git-dir", str(mirror)], src)
    if (tree / ".git").exists():
        return lambda src: _git_show(["-C", str(tree)], src)
    info = tree / "PKG-INFO"
    version = next((line.split(":", 1)[1].strip() for line in info.read_text().splitlines()
                    if line.startswith("Version:")), None) if info.is_file() else None  # fmt: skip
    if version != REF.removeprefix("v"):
        raise OSError(f"--tree {tree}: neither a git checkout (read at {REF}) nor vLLM {REF}'s "
                      f"unpacked sdist (PKG-INFO says {version or 'nothing'})")
    return lambda src: (tree / src).read_text()


def _git_show(where: list[str], src: str) -> str:
    return subprocess.run(["git", *where, "show", f"{REF}:{src}"],
                          check=True, capture_output=True, text=True).stdout  # fmt: skip


def write_stub(dest: pathlib.Path) -> None:
    """A stand-in ``vllm`` package at ``dest/vllm`` whose kimi_k3/nvidia is the overlay folder."""
    pkg = dest / "vllm"
    (pkg / "models" / "kimi_k3").mkdir(parents=True, exist_ok=True)
    for init in (pkg, pkg / "models", pkg / "models" / "kimi_k3"):
        (init / "__init__.py").write_text("")
    (pkg / "triton_utils.py").write_text("import triton\nimport triton.language as tl\n\nHAS_TRITON = True\n")
    link = pkg / "models" / "kimi_k3" / "nvidia"
    if not link.exists():
        link.symlink_to(OVERLAY_PKG, target_is_directory=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3lab.decode_step.imports")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("extract", "pristine"):
        ex = sub.add_parser(cmd)
        ex.add_argument("dest", type=pathlib.Path)
        ex.add_argument("--mirror", type=pathlib.Path, default=DEFAULT_MIRROR)
        ex.add_argument("--tree", type=pathlib.Path)
    st = sub.add_parser("stub")
    st.add_argument("dest", type=pathlib.Path)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "extract":
            extract_stock(args.dest, args.mirror, args.tree)
        elif args.cmd == "pristine":
            extract_pristine(args.dest, args.mirror, args.tree)
        else:
            write_stub(args.dest)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
