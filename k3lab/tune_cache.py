"""Resumable measurement cache for the tuner: JSON lines, one file per (GPU, M).

Layout: ``<cache_dir>/<gpu_slug>/m<M>.jsonl``. Each line is one record
``{"N", "K", "M", "cfg", "pass", ...}`` where ``cfg`` is a config list, or one
of the tags ``"cublas"``, ``"dsv3"``, ``"done"`` (pass-1 finished for this
shape: ``best_speedup``), ``"done2"`` (pass 2 finished), ``"skip"`` (pruned,
``reason``), ``"pending"`` (timing started; left alone only if the worker died).
A later record for the same key replaces an earlier one. Only the worker tuning
M writes ``m<M>.jsonl``; others only read it.
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterator


def gpu_slug(name: str) -> str:
    """File-safe form of a GPU name, e.g. ``NVIDIA H200`` -> ``NVIDIA_H200``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "gpu"


def key_of(rec: dict) -> tuple:
    cfg = rec["cfg"]
    return (rec["N"], rec["K"], rec["M"], tuple(cfg) if isinstance(cfg, list) else cfg, rec["pass"])


def path_for(cache_dir: str, gpu: str, m: int) -> str:
    return os.path.join(cache_dir, gpu_slug(gpu), f"m{m}.jsonl")


def read(cache_dir: str, gpu: str, m: int) -> dict[tuple, dict]:
    """All records for one (GPU, M), later lines winning; torn last lines ignored."""
    out: dict[tuple, dict] = {}
    p = path_for(cache_dir, gpu, m)
    if not os.path.exists(p):
        return out
    with open(p) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a killed call
            out[key_of(rec)] = rec
    return out


def read_all(cache_dir: str, gpu: str) -> Iterator[dict]:
    d = os.path.join(cache_dir, gpu_slug(gpu))
    if not os.path.isdir(d):
        return
    for name in sorted(os.listdir(d)):
        mm = re.fullmatch(r"m(\d+)\.jsonl", name)
        if mm:
            yield from read(cache_dir, gpu, int(mm.group(1))).values()


class Writer:
    """Append-only writer for one (GPU, M) file; every record is flushed and fsynced."""

    def __init__(self, cache_dir: str, gpu: str, m: int):
        p = path_for(cache_dir, gpu, m)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        self.f = open(p, "a")

    def put(self, rec: dict) -> None:
        self.f.write(json.dumps(rec, sort_keys=True) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())
