"""pytest plugin: each test's outcome appended to a JSON-lines file the moment it is known.

``-p gpu_stage.pytest_record`` with ``$K3_PYTEST_RECORD`` naming the file. A suite the GPU
stage stops at its deadline (its process killed, so no JUnit and no summary) still leaves
what ran; ``counts`` turns the files of a suite's shards into the report's counts. Lines,
each with ``"shard"`` (``$K3_SHARD``'s index, see ``compile_shards.py``, or ``"-"``):

* ``{"collected": N}``: the tests this process will run;
* ``{"nodeid", "when", "outcome", "duration"}`` per phase report (setup, call, teardown;
  ``duration`` in seconds), plus ``"longrepr"`` (clipped) when it failed;
* ``{"nodeid", "when": "collect", "outcome": "failed", "longrepr"}`` per collection error;
* ``{"finished": exit status}`` at the end of a session that was not killed.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

ENV = "K3_PYTEST_RECORD"
SHARD_ENV = "K3_SHARD"
COUNT_KEYS = ("passed", "failed", "skipped", "errors", "env_errors")
LONGREPR_CHARS = 4000


class Recorder:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1, encoding="utf-8")
        self._shard = os.environ.get(SHARD_ENV, "-").split("/")[0]

    def write(self, **entry) -> None:
        self._file.write(json.dumps({**entry, "shard": self._shard}) + "\n")
        self._file.flush()

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.write(nodeid=report.nodeid, when="collect", outcome="failed",
                       longrepr=str(report.longrepr)[-LONGREPR_CHARS:])

    def pytest_collection_finish(self, session) -> None:
        self.write(collected=len(session.items))

    def pytest_runtest_logreport(self, report) -> None:
        entry = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                 "duration": round(report.duration, 3)}
        if report.failed:
            entry["longrepr"] = str(report.longrepr)[-LONGREPR_CHARS:]
        self.write(**entry)

    def pytest_sessionfinish(self, exitstatus) -> None:
        self.write(finished=int(exitstatus))
        self._file.close()


def pytest_configure(config) -> None:
    # Our overlay's GPU test files are marked ``gpu``; vLLM's tree does not register it.
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (our overlay's GPU test files)")
    if os.environ.get(ENV):
        config.pluginmanager.register(Recorder(os.environ[ENV]), "k3_pytest_record")


def read(path: Path) -> list[dict]:
    """The file's entries; a last line cut short by a kill is dropped."""
    entries = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return entries


def outcomes(entries: list[dict]) -> dict[str, dict]:
    """``{nodeid: {"kinds", "called", "seconds", "shard", "text"}}``.

    As in JUnit: a failed call is ``failed``, a failed setup, teardown or collection
    ``errors``, a skip in any phase ``skipped``; a test with none of these and a passed
    call is passed. A collection error seen by several shards is one.
    """
    tests: dict[str, dict] = defaultdict(lambda: {"kinds": set(), "seconds": 0.0, "called": False,
                                                  "shard": "-", "text": ""})
    for e in entries:
        if "nodeid" not in e:
            continue
        t = tests[e["nodeid"]]
        t["seconds"] += e.get("duration", 0.0)
        t["shard"] = e.get("shard", "-")
        if e["outcome"] == "skipped":
            t["kinds"].add("skipped")
        elif e["outcome"] == "failed":
            t["kinds"].add("failed" if e["when"] == "call" else "errors")
            if e.get("longrepr", "") not in t["text"]:
                t["text"] += e.get("longrepr", "") + "\n"
        elif e["when"] == "call":
            t["called"] = True
    return dict(tests)


def counts(entries: list[dict], tree: Path, classify) -> dict:
    """Counts as ``cpu_tier.count_junit`` gives them, from the entries of a suite's shards.

    ``classify(text, tree)`` names an environment cause of a failure (or None); such a
    failure counts as ``env_errors``. Adds ``collected`` (over the shards), ``ran`` (the
    tests that reached an outcome; one killed mid-way did not) and ``finished`` (the worst
    exit status, absent when a shard was killed).
    """
    result = dict.fromkeys(COUNT_KEYS, 0)
    causes = set()
    tests = outcomes(entries)
    for t in tests.values():
        bad = t["kinds"] & {"failed", "errors"}
        cause = classify(t["text"], tree) if bad else None
        if cause:
            result["env_errors"] += 1
            causes.add(cause)
        else:
            for kind in ("failed", "errors"):
                result[kind] += kind in bad
        result["skipped"] += "skipped" in t["kinds"]
        result["passed"] += t["called"] and not t["kinds"]
    if causes:
        result["env_causes"] = sorted(causes)
    result["ran"] = sum(1 for t in tests.values() if t["called"] or t["kinds"])
    per_shard = {e.get("shard", "-"): e["collected"] for e in entries if "collected" in e}
    if per_shard:
        result["collected"] = sum(per_shard.values())
    shards, finished = set(per_shard), {e.get("shard", "-"): e["finished"] for e in entries
                                        if "finished" in e}
    if finished and set(finished) >= shards:
        result["finished"] = max(finished.values())
    return result


def timing(entries: list[dict], slowest: int = 8) -> dict:
    """Where a suite's time went: summed test seconds, per shard, the slowest tests."""
    tests = outcomes(entries)
    per_shard: dict[str, float] = defaultdict(float)
    for t in tests.values():
        per_shard[t["shard"]] += t["seconds"]
    top = sorted(tests.items(), key=lambda i: -i[1]["seconds"])[:slowest]
    return {"test_s": round(sum(per_shard.values()), 1),
            "shard_s": {s: round(v, 1) for s, v in sorted(per_shard.items())},
            "slowest": [[nodeid, round(t["seconds"], 2)] for nodeid, t in top]}
