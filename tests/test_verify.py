"""Static verification: touched files compile, imports of touched modules resolve."""

from __future__ import annotations

from pathlib import Path

from k3overlay.verify import module_name, verify

from .conftest import write


def tree(tmp_path: Path, files: dict[str, str]) -> Path:
    write(tmp_path, files)
    return tmp_path


def test_module_name():
    assert module_name("vllm/models/x.py") == "vllm.models.x"
    assert module_name("vllm/models/__init__.py") == "vllm.models"


def test_syntax_error_in_touched_file(tmp_path):
    root = tree(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "def f(:\n"})
    result = verify(root, ["pkg/a.py"])
    assert not result.ok and result.errors[0].startswith("pkg/a.py:1: does not compile")


def test_untouched_broken_file_is_not_ours_to_judge(tmp_path):
    root = tree(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "X = 1\n", "pkg/bad.py": "def (:\n"})
    assert verify(root, ["pkg/a.py"]).ok


def test_absolute_and_relative_imports_are_resolved(tmp_path):
    root = tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "",
        "pkg/sub/mod.py": "import os\nif os:\n    A = 1\ntry:\n    B = 2\nexcept ImportError:\n    C = 3\n"
                          "def f():\n    pass\nclass K:\n    pass\nD: int = 4\n",
        "pkg/sub/user.py": "from .mod import A, B, C\nfrom pkg.sub.mod import f, K, D, os\n",
        "pkg/other.py": "from .sub.mod import A, GONE\nfrom .sub import mod\n",
    })
    result = verify(root, ["pkg/sub/mod.py"])
    assert result.errors == ["pkg/other.py:1: cannot import name 'GONE' from pkg.sub.mod"]


def test_package_submodules_and_dynamic_modules(tmp_path):
    root = tree(tmp_path, {
        "pkg/__init__.py": "def __getattr__(name):\n    return name\n",
        "pkg/dyn.py": "X = 1\n",
        "pkg/user.py": "from pkg import anything, dyn\n",
        "lib/__init__.py": "",
        "lib/x.py": "from .y import *\n",
        "lib/user.py": "from lib.x import whatever\nfrom lib import x, missing\n",
    })
    result = verify(root, ["pkg/__init__.py", "lib/x.py", "lib/__init__.py"])
    assert result.errors == ["lib/user.py:2: cannot import name 'missing' from lib"]
