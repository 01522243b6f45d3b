"""The deployment modes of vLLM v0.28.0 for Kimi-K3 at decode, as data (``modes.json``).

A mode is what a user's flags make v0.28.0 run on one GPU kind at TP8: the capture
(breakable CUDA graphs or one full graph), the MoE branch, the router gate's tier, where
the shared experts run and on which stream, the latent tail, the token counts per rank.
Each of a layer's sites is a field whose value names the branch taken; ``why`` in the
data says, per ``field=value``, where v0.28.0 decides it (file:line).

``python -m k3lab.decode_step.modes [NAME]`` prints the modes (or one mode's branches per
layer). Exit codes: 0 done, 3 a mode the data does not name (:data:`UNKNOWN_MODE`).

A mode's ``runs`` are the decoder layers its decode step runs: the KDA and MLA layers
always, the MTP layer only where a ``--speculative-config`` drafts (``h200-mtp``: one draft
token, so a step of R requests has M = R x 2 tokens, :func:`token_counts`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from functools import lru_cache

DATA = pathlib.Path(__file__).resolve().parent / "modes.json"
UNKNOWN_MODE = 3  # exit code: a mode name the data does not hold
NOT_REPLAYABLE = 4  # exit code: a mode whose kernels do not run on the H200 (data only)
NOT_RUN = 5  # exit code: a layer the mode's decode step does not run (MTP without drafting)
LAYERS = ("kda", "mla", "mtp")
# a file:line of v0.28.0 (or of our overlay): path.py:N, N-M or N,M lists
WHERE = re.compile(r"[\w/]+\.py:\d+")


class UnknownMode(ValueError):
    """A mode name the data does not hold; ``exit_code`` is :data:`UNKNOWN_MODE`."""

    exit_code = UNKNOWN_MODE


class NotReplayable(ValueError):
    """A mode whose kernels do not run on the H200 (data only); ``exit_code`` is
    :data:`NOT_REPLAYABLE`."""

    exit_code = NOT_REPLAYABLE


@lru_cache(maxsize=None)
def load(path: pathlib.Path = DATA) -> dict:
    """The parsed data file (OSError / ValueError if it is unreadable or not JSON)."""
    return json.loads(pathlib.Path(path).read_text())


def names(data: dict | None = None) -> list[str]:
    """Every mode's name, in the data's order."""
    return list((data or load())["modes"])


def mode(name: str, data: dict | None = None) -> dict:
    """One mode's record; :class:`UnknownMode` (one line, naming the known ones) otherwise."""
    data = data or load()
    if name not in data["modes"]:
        raise UnknownMode(f"unknown mode {name!r}; known: {', '.join(names(data))}")
    return data["modes"][name]


def replayable(name: str, data: dict | None = None) -> dict:
    """The record of a mode whose kernels run on the H200; :class:`UnknownMode` or
    :class:`NotReplayable` (one line each) otherwise."""
    rec = mode(name, data)
    if not rec["replay"]:
        raise NotReplayable(f"mode {name!r} ({rec['gpu']}) is data only: its kernels do not run on the H200")
    return rec


class NotRun(ValueError):
    """A layer the mode's decode step does not run; ``exit_code`` is :data:`NOT_RUN`."""

    exit_code = NOT_RUN


def layers_run(name: str, data: dict | None = None, asked: list[str] | None = None) -> list[str]:
    """The layers of ``asked`` (default: all the mode runs) that mode ``name``'s decode step
    runs; :class:`NotRun` (one line) for one it does not, :class:`UnknownMode` for the mode."""
    runs = mode(name, data)["runs"]
    missing = [layer for layer in asked or runs if layer not in runs]
    if missing:
        raise NotRun(f"mode {name!r} runs no {', '.join(missing)} layer (its decode step runs "
                     f"{', '.join(runs)}; the MTP layer runs only with a --speculative-config: "
                     "h200-mtp)")  # fmt: skip
    return list(asked or runs)


def branches(name: str, layer: str, data: dict | None = None) -> dict[str, str]:
    """``{field: value}`` for each site of ``layer`` (one of :data:`LAYERS`) in mode ``name``:
    the mode's ``all`` values, then the layer's own overrides, restricted to the layer's fields.
    KeyError for a layer the data does not list."""
    data = data or load()
    rec = mode(name, data)
    values = {**rec["all"], **rec.get("layers", {}).get(layer, {})}
    return {f: values[f] for f in data["layer_fields"][layer] if f in values}


#: v0.28.0's default CUDA-graph capture sizes (config/vllm.py:1965-1981): 1, 2, 4, steps
#: of 8 below 256, steps of 16 up to the largest, which is at most 512 off SM100
#: (min(2 x max_num_seqs x (1 + drafts), 512), config/vllm.py:1933-1942).
CAPTURE_SIZES = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))


def drafts(br: dict[str, str]) -> int:
    """Draft tokens per request of a step under the branches ``br`` (``tokens``: 0, or K of
    ``capture_sizes_drafts_K``)."""
    value = br.get("tokens", "")
    prefix = "capture_sizes_drafts_"
    return int(value.removeprefix(prefix)) if value.startswith(prefix) else 0


def tokens_run(m: int, br: dict[str, str]) -> int:
    """The token count the kernels of a step of ``m`` tokens see under the branches ``br``:
    the next capture size up (``tokens=capture_sizes``: the step runs the graph captured for
    it, padded); with K = 1 or 3 draft tokens the sizes are rounded up to multiples of 1 + K
    (v1/worker/gpu/cudagraph_utils.py:238-311). ValueError past the largest (that batch runs
    no graph), for another K, and for an ``m`` that is not requests x (1 + K)."""
    if not br.get("tokens", "").startswith("capture_sizes"):
        return m
    per = 1 + drafts(br)
    if per not in (1, 2, 4):  # K = 2 runs some sizes in the breakable graph (cudagraph_utils.py:266-297)
        raise ValueError(f"{per - 1} draft tokens: the capture sizes of K = 2 or K > 3 are not modelled")
    if m % per:
        raise ValueError(f"{m} tokens: a step with {per - 1} draft token(s) has requests x {per} tokens")
    for size in CAPTURE_SIZES:
        padded = -(-size // per) * per  # the graph a step of this size is captured at
        if padded >= m:
            return padded
    raise ValueError(f"{m} tokens: past the largest capture size {CAPTURE_SIZES[-1]}")


def token_counts(name: str, most: int = 16, data: dict | None = None) -> list[int]:
    """The token counts 1..``most`` a decode step of mode ``name`` can have (all of them
    without drafting; requests x (1 + K) with K draft tokens)."""
    per = 1 + max(drafts(branches(name, layer, data)) for layer in mode(name, data)["runs"])
    return list(range(per, most + 1, per))


def why(field: str, value: str, data: dict | None = None) -> str:
    """Where v0.28.0 decides ``field=value`` (KeyError if the data does not say)."""
    return (data or load())["why"][f"{field}={value}"]


def problems(data: dict | None = None) -> list[str]:
    """Every way the data is incomplete or inconsistent, one line each (empty: sound).

    Checked: each mode names the layers it runs (``runs``: KDA and MLA at least), gives every field of
    each a value the field allows, each ``field=value`` in use has a why with a file:line, no
    why is unused, and each GPU kind has exactly one default mode."""
    data = data or load()
    out, used, defaults = [], set(), {}
    for name, rec in data["modes"].items():
        if rec.get("default"):
            defaults.setdefault(rec["arch"], []).append(name)
        runs = rec.get("runs", [])
        if not {"kda", "mla"} <= set(runs) or not set(runs) <= set(LAYERS):
            out.append(f"{name}: layers {runs} must hold kda and mla, each of {list(LAYERS)}")
        for layer in (x for x in runs if x in LAYERS):
            got = branches(name, layer, data)
            for field in data["layer_fields"][layer]:
                value = got.get(field)
                if value is None:
                    out.append(f"{name}/{layer}: no value for {field}")
                elif value not in data["fields"].get(field, ()):
                    out.append(f"{name}/{layer}: {field}={value} is not one of {data['fields'].get(field)}")
                elif not WHERE.search(data["why"].get(f"{field}={value}", "")):
                    out.append(f"{name}/{layer}: {field}={value} has no why with a file:line")
                used.add(f"{field}={value}")
    out += [f"why[{k}] is used by no mode" for k in data["why"] if k not in used]
    for arch in {rec["arch"] for rec in data["modes"].values()}:
        if len(defaults.get(arch, [])) != 1:
            out.append(f"{arch}: {len(defaults.get(arch, []))} default modes, want 1")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3lab.decode_step.modes", description=__doc__.split("\n")[0])
    ap.add_argument("name", nargs="?")
    args = ap.parse_args(argv)
    if args.name is None:
        for name in names():
            rec = mode(name)
            print(f"{name:32} {rec['gpu']:22} {'default' if rec['default'] else '':8} {rec['how']}")
        return 0
    try:
        mode(args.name)
    except UnknownMode as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    for layer in layers_run(args.name):
        for field, value in branches(args.name, layer).items():
            print(f"{layer:4} {field:20} {value:24} {why(field, value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
