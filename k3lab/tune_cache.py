"""Resumable measurement cache for the tuner: JSON lines, one file per (GPU, M).

Layout: ``<cache_dir>/<gpu_slug>/m<M>.jsonl``. Each line is one record
``{"N", "K", "M", "cfg", "pass", ...}`` where ``cfg`` is a config list, or one
of the tags ``"cublas"``, ``"dsv3"``, ``"done"`` (pass-1 finished for this
shape: ``best_speedup``), ``"done2"`` (pass 2 finished), ``"skip"`` (pruned,
``reason``), ``"pending"`` (timing started; left alone only if the worker died).
A later record for the same key replaces an earlier one. Only the worker tuning
M writes ``m<M>.jsonl``; others only read it.

What git keeps of a cache is one file per GPU, ``<cache_dir>/<gpu_slug>.jsonl.gz``
(``results/tune_cache/NVIDIA_H200.jsonl.gz``): every record, sorted, compressed. It is
read as if it came before the per-M files, so a tuner pointed at a folder holding it
resumes where the committed run stopped and its own new records win. ``pack`` writes it::

    python -m k3lab.tune_cache pack CACHE_DIR "NVIDIA H200" results/tune_cache/NVIDIA_H200.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
from typing import Iterable, Iterator


def gpu_slug(name: str) -> str:
    """File-safe form of a GPU name, e.g. ``NVIDIA H200`` -> ``NVIDIA_H200``."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "gpu"


def key_of(rec: dict) -> tuple:
    cfg = rec["cfg"]
    return (rec["N"], rec["K"], rec["M"], tuple(cfg) if isinstance(cfg, list) else cfg, rec["pass"])


def path_for(cache_dir: str, gpu: str, m: int) -> str:
    return os.path.join(cache_dir, gpu_slug(gpu), f"m{m}.jsonl")


def packed_path(cache_dir: str, gpu: str) -> str:
    """The one compressed file per GPU that git keeps."""
    return os.path.join(cache_dir, gpu_slug(gpu) + ".jsonl.gz")


def _records(lines: Iterable[str]) -> Iterator[dict]:
    for line in lines:
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a killed call


def _packed(cache_dir: str, gpu: str) -> list[dict]:
    p = packed_path(cache_dir, gpu)
    if not os.path.exists(p):
        return []
    with gzip.open(p, "rt") as f:
        return list(_records(f))


def read(cache_dir: str, gpu: str, m: int) -> dict[tuple, dict]:
    """All records for one (GPU, M), the packed file first, later lines winning; torn
    last lines ignored."""
    out: dict[tuple, dict] = {key_of(r): r for r in _packed(cache_dir, gpu) if r["M"] == m}
    p = path_for(cache_dir, gpu, m)
    if os.path.exists(p):
        with open(p) as f:
            for rec in _records(f):
                out[key_of(rec)] = rec
    return out


def _ms(cache_dir: str, gpu: str) -> list[int]:
    ms = {r["M"] for r in _packed(cache_dir, gpu)}
    d = os.path.join(cache_dir, gpu_slug(gpu))
    if os.path.isdir(d):
        ms |= {int(mm.group(1)) for name in os.listdir(d)
               if (mm := re.fullmatch(r"m(\d+)\.jsonl", name))}
    return sorted(ms)


def read_all(cache_dir: str, gpu: str) -> Iterator[dict]:
    for m in _ms(cache_dir, gpu):
        yield from read(cache_dir, gpu, m).values()


def pack(cache_dir: str, gpu: str, out: str) -> int:
    """Write every record of ``cache_dir`` for ``gpu`` (packed file and per-M files merged,
    later winning) to ``out`` as sorted, compressed JSON lines; returns the record count.
    The gzip header carries no name or date, so the same records give the same bytes."""
    records = sorted(read_all(cache_dir, gpu), key=lambda r: json.dumps(key_of(r)))
    data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        f.write(data)
    os.replace(tmp, out)
    return len(records)


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Pack a tuner cache into the one file per GPU git keeps.")
    sub = ap.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="CACHE_DIR GPU OUT.jsonl.gz")
    p.add_argument("cache_dir")
    p.add_argument("gpu", help='the GPU name as torch gives it, e.g. "NVIDIA H200"')
    p.add_argument("out")
    args = ap.parse_args(argv)
    n = pack(args.cache_dir, args.gpu, args.out)
    print(f"{args.out}: {n} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
