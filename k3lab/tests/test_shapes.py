"""k3lab/shapes.py's labels: one local shape per projection and tensor-parallel layout."""

from __future__ import annotations

from collections import defaultdict

from k3lab import shapes


def test_each_projection_has_one_shape_per_layout():
    """A projection has one local (N, K) at a given TP degree: two shapes of ``q_b_proj`` both
    labelled TP8 (2304x1536 and 4608x1536) meant one of them was mislabelled (it is TP4)."""
    seen: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
    for shape, (label, layouts) in shapes.SHAPES.items():
        if "/" in label or "(" in label:
            continue  # a shape two projections share, or a row view: no one-to-one claim
        for layout in layouts.split("+"):
            seen[label, layout].append(shape)
    assert {key: found for key, found in seen.items() if len(found) > 1} == {}


def test_a_tp4_shape_is_a_tp8_shape_widened():
    """Going from TP8 to TP4 doubles N (column-parallel) or K (row-parallel), never both."""
    by_label = defaultdict(dict)
    for (n, k), (label, layouts) in shapes.SHAPES.items():
        for layout in layouts.split("+"):
            by_label[label][layout] = (n, k)
    pairs = [(v["TP8"], v["TP4"]) for v in by_label.values() if "TP8" in v and "TP4" in v]
    assert pairs
    for (n8, k8), (n4, k4) in pairs:
        assert (k4 == k8 and n4 > n8) or (n4 == n8 and k4 == 2 * k8), ((n8, k8), (n4, k4))
