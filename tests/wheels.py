"""Small vLLM-like release wheels, made in the test with ``wheel``'s WheelFile."""

from __future__ import annotations

import tempfile
import zipfile
from pathlib import Path

from wheel.wheelfile import WheelFile

METADATA = ("Metadata-Version: 2.4\nName: vllm\nVersion: {version}\nSummary: a test release\n"
            "Requires-Dist: numpy\n\nFrom the description: a line that starts with From.\n")


def make_wheel(directory: Path, version: str, files: dict[str, bytes | str], *,
               tags: str = "py3-none-any", wheel_tag: str | None = None) -> Path:
    """``directory/vllm-<version>-<tags>.whl`` holding ``files`` and a dist-info whose WHEEL
    says ``Tag: <wheel_tag or tags>`` (vLLM's own say linux_x86_64 in a manylinux file)."""
    path = directory / f"vllm-{version}-{tags}.whl"
    directory.mkdir(parents=True, exist_ok=True)
    info = f"vllm-{version}.dist-info"
    with WheelFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{info}/METADATA", METADATA.format(version=version))
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
                                        f"Tag: {wheel_tag or tags}\n")
        wheel.writestr(f"{info}/top_level.txt", "vllm\n")
    return path


def wheel_bytes(version: str, files: dict[str, bytes | str], **kwargs) -> bytes:
    """The bytes of ``make_wheel`` (for serving from the fake index)."""
    with tempfile.TemporaryDirectory() as tmp:
        return make_wheel(Path(tmp), version, files, **kwargs).read_bytes()


def member(path: Path, name: str) -> bytes:
    """The bytes of entry ``name`` of the zip file at ``path``."""
    with zipfile.ZipFile(path) as archive:
        return archive.read(name)
