"""The deployment modes as data (k3lab/decode_step/modes.json), on the CPU."""

from __future__ import annotations

import copy

import pytest

from k3lab.decode_step import modes


def test_the_modes_data_is_complete_and_consistent() -> None:
    assert modes.problems() == []


def test_every_layer_of_every_mode_has_a_branch_and_a_file_line() -> None:
    data = modes.load()
    for name in modes.names():
        for layer in modes.LAYERS:
            got = modes.branches(name, layer)
            assert set(got) == set(data["layer_fields"][layer]), (name, layer)
            for field, value in got.items():
                assert modes.WHERE.search(modes.why(field, value)), (name, layer, field)


@pytest.mark.parametrize(
    "breakage,want",
    [
        (lambda d: d["modes"]["h200-default"]["all"].pop("gate_tier"), "no value for gate_tier"),
        (lambda d: d["modes"]["h200-default"]["all"].update(capture="unbroken"), "capture=unbroken is not one of"),
        (lambda d: d["why"].update({"latent_tail=allreduce_overlap": "the runner, somewhere"}), "no why with a file:line"),
        (lambda d: d["why"].update({"capture=eager": "x.py:1"}), "why[capture=eager] is used by no mode"),
        (lambda d: d["modes"]["h200-nobreak"].update(default=True), "sm90: 2 default modes"),
        (lambda d: d["modes"]["h200-default"].setdefault("layers", {}).update(kda={"g_proj": "fork"}), None),
        (lambda d: d["modes"]["h200-mtp"].update(runs=["kda", "mtp"]), "must hold kda and mla"),
        (lambda d: d["modes"]["h200-mtp"].update(runs=["kda", "mla", "dense"]), "must hold kda and mla"),
        (lambda d: d["modes"]["h200-mtp"]["all"].update(tokens="capture_sizes_drafts_2"), "is not one of"),
    ],
)
def test_problems_name_each_gap(breakage, want) -> None:
    data = copy.deepcopy(modes.load())
    breakage(data)
    found = modes.problems(data)
    if want is None:  # a field the layer does not have is ignored, not an error
        assert found == []
    else:
        assert any(want in p for p in found), found


def test_a_layers_override_wins_over_the_modes_values() -> None:
    data = copy.deepcopy(modes.load())
    data["modes"]["h200-piecewise"]["layers"] = {"mtp": {"gate_down": "fork"}}
    assert modes.branches("h200-piecewise", "mtp", data)["gate_down"] == "fork"
    assert modes.branches("h200-piecewise", "kda", data)["gate_down"] == "in_line"


def test_the_h200_default_is_one_full_graph_with_forks_and_c_kernels_on_the_fused_moe_branch() -> None:
    # The configuration the issue is about: what v0.28.0 runs on an H200 when the user sets
    # nothing. The breakable flag is on (_C small ops), yet a decode batch is one full graph
    # with vLLM's aux streams, padded to the capture sizes (audit_default_mode_2026-12-04.md).
    (default,) = [n for n in modes.names() if modes.mode(n)["default"] and modes.mode(n)["arch"] == "sm90"]
    assert modes.mode(default)["env"] == {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}
    kda = modes.branches(default, "kda")
    assert kda["capture"] == "full" and kda["small_ops"] == "c_kernels" and kda["moe_branch"] == "fused_moe"
    assert kda["gate_tier"] == "ll_bf16" and kda["gate_down"] == "fork"
    assert modes.branches(default, "mla")["g_proj"] == "fork"
    assert [modes.tokens_run(m, kda) for m in range(1, 17)] == [1, 2, 4, 4, *[8] * 4, *[16] * 8]
    assert all(not modes.mode(n)["replay"] for n in modes.names() if modes.mode(n)["arch"] != "sm90")
    # no mode of any GPU decodes under the breakable capture unless the user asked for PIECEWISE
    assert [n for n in modes.names() if modes.branches(n, "kda")["capture"] == "breakable"] == ["h200-piecewise"]


def test_a_step_past_the_largest_capture_size_runs_no_graph() -> None:
    br = modes.branches("h200-default", "kda")
    assert modes.tokens_run(17, br) == 24 and modes.tokens_run(249, br) == 256
    assert modes.tokens_run(257, br) == 272 and modes.tokens_run(512, br) == 512
    with pytest.raises(ValueError, match="past the largest"):
        modes.tokens_run(513, br)


def test_an_unknown_mode_is_one_line_with_its_own_exit_code(capsys) -> None:
    assert modes.main(["h100-default"]) == modes.UNKNOWN_MODE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown mode 'h100-default'" in err and "h200-default" in err
    assert modes.UNKNOWN_MODE not in (0, 1, 2)


def test_the_cli_prints_every_mode_and_one_modes_branches(capsys) -> None:
    assert modes.main([]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in modes.names())
    assert modes.main(["h200-nobreak"]) == 0
    out = capsys.readouterr().out
    assert "gate_down" in out and "fork" in out and "multi_stream_utils.py" in out


@pytest.mark.parametrize("name,code", [("h100-default", modes.UNKNOWN_MODE), ("b200-default", modes.NOT_REPLAYABLE)])
def test_the_model_check_refuses_a_mode_it_cannot_run_in_one_line(name, code, tmp_path, capsys) -> None:
    from k3lab.decode_step import model_check

    assert model_check.main(["--mode", name, "--out", str(tmp_path / "out")]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and name in err
    assert not (tmp_path / "out").exists(), "nothing written for a refused mode"


def test_only_a_drafting_mode_runs_the_mtp_layer() -> None:
    # v0.28.0 runs the MTP layer only with a --speculative-config (engine/arg_utils.py): the
    # default modes' steps are the KDA and MLA layers; h200-mtp adds the draft step.
    assert [n for n in modes.names() if "mtp" in modes.mode(n)["runs"]] == ["h200-mtp"]
    assert modes.layers_run("h200-default") == ["kda", "mla"]
    assert modes.layers_run("h200-mtp", asked=["mtp"]) == ["mtp"]
    with pytest.raises(modes.NotRun, match="runs no mtp layer") as e:
        modes.layers_run("h200-default", asked=["kda", "mtp"])
    assert e.value.exit_code == modes.NOT_RUN and modes.NOT_RUN not in (0, 1, 2, 3, 4)
    # the drafting mode's other branches are the default's: the same graph, forks and kernels
    for layer in ("kda", "mla"):
        mtp, default = modes.branches("h200-mtp", layer), modes.branches("h200-default", layer)
        assert {f: v for f, v in mtp.items() if v != default[f]} == {"tokens": "capture_sizes_drafts_1"}


def test_a_drafting_step_has_requests_x_2_tokens_padded_to_even_capture_sizes() -> None:
    # K = 1: M = R x 2, full graphs at round_up(size, 2) (v1/worker/gpu/cudagraph_utils.py)
    br = modes.branches("h200-mtp", "mtp")
    assert modes.drafts(br) == 1 and modes.drafts(modes.branches("h200-default", "mtp")) == 0
    assert modes.token_counts("h200-mtp") == list(range(2, 17, 2))
    assert modes.token_counts("h200-default") == list(range(1, 17))
    assert [modes.tokens_run(m, br) for m in range(2, 17, 2)] == [2, 4, 8, 8, 16, 16, 16, 16]
    assert modes.tokens_run(18, br) == 24
    for odd in (1, 3, 15):
        with pytest.raises(ValueError, match="requests x 2 tokens"):
            modes.tokens_run(odd, br)
    # K = 3 pads as K = 1 does (4, 8, 16); K = 2 runs M = 12, 15 in the breakable graph
    k3 = {"tokens": "capture_sizes_drafts_3"}
    assert [modes.tokens_run(m, k3) for m in (4, 8, 12, 16)] == [4, 8, 16, 16]
    with pytest.raises(ValueError, match="not modelled"):
        modes.tokens_run(12, {"tokens": "capture_sizes_drafts_2"})


def test_the_cli_prints_only_the_layers_a_mode_runs(capsys) -> None:
    assert modes.main(["h200-default"]) == 0
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("mtp")]
    assert modes.main(["h200-mtp"]) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("mtp")]
