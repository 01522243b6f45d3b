"""v0.28.0's own Kimi-K3 layers, one decode forward per deployment mode, under the profiler (issue 27).

Builds vLLM v0.28.0's ``KimiDecoderLayer`` (one KDA layer, one MLA layer) and the MTP layer
(``KimiK3MultiTokenPredictorLayer``) on one GPU, world size 1, with every projection at its
TP8-local shape (heads and the shared experts' width / 8; the router gate, ``routed_down`` and
``routed_up`` are replicated at TP8 anyway), captures one decode forward the way v0.28.0's
V2 model runner does in the mode (``modes.json``: its ``env`` set before v0.28.0 is
imported, its ``capture``: ``full``, the runner's FULL decode graph, one
``torch.cuda.CUDAGraph`` around the forward under a forward context of runtime mode NONE,
as v1/worker/gpu/cudagraph_utils.py:355-366 and :531-552 do, so vLLM's own stream forks
decide for themselves; ``breakable``, vLLM's ``BreakableCUDAGraphCapture``, broken at the
cores, as its PIECEWISE runner does), replays it under ``torch.profiler`` and writes the
kernels it ran (name, stream, graph segment, the layer's module or function that launched
it, its input shapes from an eager run) as JSON. One process per mode: v0.28.0 reads
``VLLM_USE_BREAKABLE_CUDAGRAPH`` when its model files are imported.

What stands in, and why (each named in the JSON's ``stand_ins``):

* compiled vLLM (``_C``) is not in the GPU bundle: ``_C.rms_norm``, ``_C.fused_add_rms_norm``
  and ``_C.situ_and_mul`` are the replay's Triton stand-ins (:mod:`k3lab.decode_step.stock`),
  registered under ``torch.ops._C``; ``weak_ref_tensor`` (a ``_C`` op) is the identity;
* the cores and the routed experts are left out, as in the replay: no attention metadata, so
  v0.28.0's own KDA and MLA cores return at once (still a graph break); the MLA attention
  backend is a stub (its kernels need ``_C``/FlashMLA); the routed experts are a
  ``torch.topk`` and a ``zeros_like`` (the Triton ``fused_moe`` needs ``_moe_C`` for its
  alignment and sums);
* world size 1 has no collectives: the TP8 all-reduces are absent, and ``LatentMoERunner``'s
  TP8 fused path is forced on (``_use_fused_path`` asks for TP > 1), so its tier-1 tail runs
  with the latent norm as RMSNorm (flashinfer's fused all-reduce + RMSNorm at TP8).

Needs the GPU bundle's tree with v0.28.0's own model files put back
(``k3lab/device/run.sh model_check PRISTINE_DIR`` after ``install``; PRISTINE_DIR from
``python -m k3lab.decode_step.imports pristine``); never runs on a CPU (``--dry-cpu`` builds the layers on
the CPU to check the construction only, with the CPU platform's MoE oracle set to Triton).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from types import SimpleNamespace

from k3lab.decode_step import modes

H, LAT, NB_ALL = 7168, 3584, 9
# TP8-local: 96 KDA heads and 96 MLA heads / 8; shared experts 6144 / 8; 384 experts replicated.
LOCAL = dict(heads=12, kda_heads=12, shared_inter=768, experts=384)
LAYER_IDX = {"kda": 43, "mla": 47, "mtp": 54}  # attn-res block 6: 8 earlier blocks, no block write
LABELLED_FUNCS = {  # module attribute -> label (functions, not nn.Modules, in v0.28.0's layers)
    "vllm.models.kimi_k3.nvidia.model": ["attn_res"],
    "vllm.models.kimi_k3.nvidia.mla": ["fused_q_kv_rmsnorm", "_gate_sigmoid_mul"],
    "vllm.models.kimi_k3.nvidia.mtp": ["fused_mtp_input"],
}


def kimi_config(cls, experts: int):
    """A KimiLinearConfig at TP8-local sizes (world size 1 sees them as whole)."""
    kda_layers = [LAYER_IDX["kda"] + 1]
    return cls(
        vocab_size=1024, hidden_size=H, head_dim=128, intermediate_size=18432, num_hidden_layers=54,
        num_attention_heads=LOCAL["heads"], hidden_act="situ", rms_norm_eps=1e-6,
        moe_intermediate_size=LOCAL["shared_inter"], num_experts=experts, num_experts_per_token=8,
        num_shared_experts=1, routed_scaling_factor=2.5, use_grouped_topk=True, num_expert_group=1,
        topk_group=1, moe_renormalize=True, moe_router_activation_func="sigmoid",
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        mla_use_nope=True, mla_use_output_gate=True, attn_res_block_size=6, latent_moe_use_norm=True,
        activation_situ_beta=1.0, routed_expert_hidden_size=LAT, num_nextn_predict_layers=1,
        linear_attn_config={"kda_layers": kda_layers, "full_attn_layers": [i for i in range(1, 56)
                            if i not in kda_layers], "head_dim": 128, "num_heads": LOCAL["kda_heads"],
                            "short_conv_kernel_size": 4, "use_full_rank_gate": True},
    )  # fmt: skip


def _situ_and_mul_out(out, x, beta: float, linear_beta: float) -> None:
    """``_C.situ_and_mul``'s schema returns nothing (``-> ()``): torch refuses an impl that
    returns the tensor (the H200 run of 2026-12-04 00:18, breakable mode, every layer)."""
    from k3lab.decode_step import stock

    stock.situ_and_mul(x, beta, out)


def register_c_stand_ins(torch) -> list[str]:
    """``torch.ops._C`` ops the layers call, on the replay's Triton stand-ins."""
    from k3lab.decode_step import stock

    lib = torch.library.Library("_C", "FRAGMENT")
    defs = {
        "rms_norm": ("(Tensor(a!) out, Tensor input, Tensor weight, float epsilon) -> ()", stock.rms_norm_out),
        "fused_add_rms_norm": ("(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon) -> ()",
                               stock.fused_add_rms_norm_),
        "situ_and_mul": ("(Tensor(a!) out, Tensor input, float beta, float linear_beta) -> ()",
                         _situ_and_mul_out),
    }  # fmt: skip
    done = []
    for name, (schema, fn) in defs.items():
        if hasattr(torch.ops._C, name):
            continue
        lib.define(name + schema)
        lib.impl(name, fn, "CUDA")
        done.append(f"_C.{name}: k3lab.decode_step.stock Triton stand-in")
    register_c_stand_ins.lib = lib  # keep the library alive
    return done


def vllm_config_for(breakable_flag: bool):
    """The config v0.28.0 derives: compile mode NONE under the breakable flag (config/vllm.py:1343-1345)."""
    from vllm.config import CacheConfig, CompilationConfig, CompilationMode, VllmConfig

    cc = CompilationConfig(mode=CompilationMode.NONE if breakable_flag else CompilationMode.VLLM_COMPILE)
    vc = VllmConfig(compilation_config=cc, cache_config=CacheConfig(), additional_config={"kda_prefill_backend": "triton"})
    return vc


def model_config_stub(cfg, torch):
    """The few ModelConfig fields the layers read (no checkpoint, no tokenizer)."""
    return SimpleNamespace(dtype=torch.bfloat16, hf_text_config=cfg, hf_config=cfg, enable_sleep_mode=False,
                           max_model_len=4096, use_mla=True, is_hybrid=True, quantization=None,
                           is_moe=True, enforce_eager=False, architectures=["KimiLinearForCausalLM"])  # fmt: skip


def stub_mla_backend(mla_mod) -> str:
    """The MLA core's backend is never run (no metadata); its selection needs compiled kernels."""

    class _Impl:
        def __init__(self, **kw):
            self.dcp_world_size, self.dcp_rank, self.lse_base_on_e = 1, 0, True

    class _Backend:
        @staticmethod
        def get_impl_cls():
            return _Impl

    mla_mod.get_attn_backend = lambda *a, **k: _Backend
    mla_mod.get_mla_prefill_backend = lambda vc: (lambda **kw: None)
    return "MLA attention backend: a stub (the core is left out; v0.28.0's returns at once without metadata)"


def stub_routed_experts(runner, torch) -> None:
    """The routed experts (left out of the replay too): a top-k and a zero latent."""
    k = runner.moe_config.experts_per_token if hasattr(runner.moe_config, "experts_per_token") else 8

    def select_experts(hidden_states, router_logits, **kw):
        w, ids = torch.topk(router_logits, k, dim=-1)
        return w, ids.to(torch.int32)

    def routed(x, *a, **kw):
        return torch.zeros_like(x)

    runner.router.select_experts = select_experts
    runner.routed_experts.forward_modular = routed
    runner.routed_experts.forward_monolithic = routed


LAUNCHES: list[dict] = []  # (label, stream, segment) of every labelled call while capturing
CAPTURING: dict = {"on": False, "cap": None}


CALLS: dict = {}  # label -> calls so far in this forward (a second call is "label#2")


def _call_label(label: str) -> str:
    n = CALLS[label] = CALLS.get(label, 0) + 1
    return label if n == 1 else f"{label}#{n}"


def _note(torch, label: str) -> None:
    if CAPTURING["on"]:
        cap = CAPTURING["cap"]
        LAUNCHES.append({"label": label, "stream": torch.cuda.current_stream().cuda_stream,
                         "segment": len(cap.segments) if cap is not None else 0})  # fmt: skip


def label_everything(torch, layer) -> None:
    """record_function ranges (and capture-time stream/segment notes) around every submodule
    and v0.28.0's layer-level functions."""
    import importlib

    from torch.profiler import record_function

    def pre(m, a, name):
        name = _call_label(name)
        _note(torch, name)
        m._k3_rf = record_function("k3:" + name)
        m._k3_rf.__enter__()

    for name, mod in layer.named_modules():
        if name:
            mod.register_forward_pre_hook(lambda m, a, name=name: pre(m, a, name))
            mod.register_forward_hook(lambda m, a, o: m._k3_rf.__exit__(None, None, None))

    def wrap(fn, label):
        if getattr(fn, "_k3_labelled", False):
            return fn

        def wrapped(*a, **k):
            lab = _call_label(label)
            _note(torch, lab)
            with record_function("k3:" + lab):
                return fn(*a, **k)

        wrapped._k3_labelled = True
        return wrapped

    for modname, funcs in LABELLED_FUNCS.items():
        mod = importlib.import_module(modname)
        for f in funcs:
            setattr(mod, f, wrap(getattr(mod, f), f))
    from vllm.models.kimi_k3.nvidia import latent_moe_runner as lmr

    for meth in ("_overlap_allreduce_tail", "allreduce_norm_latent_out", "_small_batch_tail", "_shard_up_proj_tail"):
        setattr(lmr.LatentMoERunner, meth, wrap(getattr(lmr.LatentMoERunner, meth), meth))


def init_weights(torch, module) -> None:
    """Random, finite weights (never time on garbage): norms ~ 1, projections ~ N(0, 1/K)."""
    g = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(0)
    for name, p in module.named_parameters():
        if "w13" in name or "w2_" in name or name.endswith("w2_weight"):
            continue  # routed experts: left out, never read
        if p.dim() == 1:
            p.data.fill_(0.0 if "bias" in name else 1.0)
        elif p.dim() >= 2 and p.is_floating_point():
            p.data.normal_(0.0, p.shape[-1] ** -0.5, generator=g)


def build(layer: str, cfg, vc, torch):
    """v0.28.0's own layer at index LAYER_IDX[layer]; the MoE runner set as at TP8."""
    from vllm.models.kimi_k3.nvidia import model as km

    if layer == "mtp":
        from vllm.models.kimi_k3.nvidia import mtp as kmtp

        mod = kmtp.KimiK3MultiTokenPredictorLayer(cfg, vc, prefix=f"model.layers.{LAYER_IDX['mtp']}")
        dec = mod.mtp_block
    else:
        mod = dec = km.KimiDecoderLayer(cfg, vc, prefix=f"model.layers.{LAYER_IDX[layer]}",
                                        aux_stream=torch.cuda.Stream() if torch.cuda.is_available() else None)
    runner = getattr(dec.mlp.experts, "runner", None) or dec.mlp.experts
    for obj in (dec.mlp.experts, runner):
        if hasattr(obj, "router") and hasattr(obj, "routed_experts"):
            runner = obj
    return mod, dec, runner


def inputs(layer: str, m: int, torch, device):
    g = torch.Generator(device=device).manual_seed(m)
    rnd = lambda *s: torch.randn(*s, generator=g, device=device).to(torch.bfloat16)  # noqa: E731
    pos = torch.arange(1, m + 1, device=device)
    if layer == "mtp":
        return dict(input_ids=pos, positions=pos, previous_hidden_states=rnd(m, H), inputs_embeds=rnd(m, H))
    return dict(positions=pos, hidden_states=rnd(m, H), residual=rnd(m, NB_ALL, H), prefix_sum=rnd(m, H))


def capture(mode: str, fwd, torch):
    """Capture ``fwd`` as a capture of kind ``mode`` (``breakable`` or ``full``) does; returns
    [(kind, replay callable)] in launch order."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        if mode == "breakable":
            from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

            cap = BreakableCUDAGraphCapture()
            CAPTURING.update(on=True, cap=cap)
            try:
                with cap:
                    fwd()
            finally:
                CAPTURING.update(on=False, cap=None)
            segs = [("graph" if isinstance(getattr(s, "__self__", None), torch.cuda.CUDAGraph) else "eager", s)
                    for s in cap.segments]
        else:
            graph = torch.cuda.CUDAGraph()
            CAPTURING.update(on=True, cap=None)
            try:
                with torch.cuda.graph(graph, stream=side):
                    fwd()
            finally:
                CAPTURING.update(on=False)
            segs = [("graph", graph.replay)]
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return segs


def profile(run, torch, path: str) -> str:
    from torch.profiler import ProfilerActivity, profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as p:
        run()
        torch.cuda.synchronize()
    p.export_chrome_trace(path)
    return path


def check_layer(layer: str, mode: str, ms, cfg, vc, torch, tmp: str) -> dict:
    from torch.profiler import record_function
    from vllm.forward_context import set_forward_context

    from k3lab.decode_step import trace_summary

    mod, dec, runner = build(layer, cfg, vc, torch)
    stub_routed_experts(runner, torch)
    init_weights(torch, mod)
    label_everything(torch, mod)
    out = {"layer": layer, "class": type(mod).__name__, "moe_runner": type(runner).__name__,
           "tail_tier_at_16": None, "per_m": {}}  # fmt: skip
    for m in ms:
        args = inputs(layer, m, torch, "cuda")
        with set_forward_context(None, vc, num_tokens=m):
            def fwd():
                CALLS.clear()
                return mod(**args)

            fwd()  # compile (Triton, CuTe DSL, Inductor) outside the profile
            torch.cuda.synchronize()
            eager = trace_summary.kernels(profile(fwd, torch, f"{tmp}/{layer}_{m}_eager.json"))
            LAUNCHES.clear()
            try:
                segs = capture(mode, fwd, torch)
                launches, graphed, err = list(LAUNCHES), None, None

                def replay():
                    for i, (kind, seg) in enumerate(segs):
                        with record_function(f"k3seg:{i}:{kind}"):
                            seg()

                replay()
                graphed = trace_summary.kernels(profile(replay, torch, f"{tmp}/{layer}_{m}_{mode}.json"))
            except Exception:  # noqa: BLE001 - keep what the eager run saw, say why the capture failed
                err, segs, graphed = traceback.format_exc()[-3000:], [], []
                LAUNCHES.clear()
                CAPTURING.update(on=True, cap=None)
                try:
                    fwd()  # eager, noted: streams as outside any capture
                finally:
                    CAPTURING.update(on=False)
                launches = list(LAUNCHES)
        out["per_m"][str(m)] = trace_summary.summarize(eager, graphed, launches, [k for k, _ in segs])
        if err:
            out["per_m"][str(m)]["capture_error"] = err
        if m == 16 and hasattr(runner, "_select_tail_tier"):
            z = torch.zeros(16, LAT, device="cuda", dtype=torch.bfloat16)
            out["tail_tier_at_16"] = runner._select_tail_tier(z, z).name
    return out


_CONFIG_CONTEXT: list = []


def setup(env: dict[str, str], experts: int, dry_cpu: bool):
    """Import v0.28.0 under the mode's environment ``env``; the config, the distributed world of one."""
    os.environ.update(env)
    import torch

    if dry_cpu:  # construction only: no CUDA streams on a CPU build of torch
        for n in ("Stream", "Event"):
            setattr(torch.cuda, n, type("No" + n, (), {"__init__": lambda self, *a, **k: None}))
    stand_ins = [] if dry_cpu else register_c_stand_ins(torch)
    if dry_cpu:  # the CPU platform has no unquantized MoE backend; SM90's oracle picks Triton
        from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as ufm
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

        ufm.select_unquantized_moe_backend = lambda *a, **k: (UnquantizedMoeBackend.TRITON, TritonExperts)
    from vllm.compilation import breakable_cudagraph as bc
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.models.kimi_k3.nvidia import latent_moe_runner as lmr
    from vllm.models.kimi_k3.nvidia import mla as mla_mod
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    bc.weak_ref_tensor = lambda t: t
    stand_ins.append("weak_ref_tensor (_C): the identity (strong references; one capture)")
    stand_ins.append(stub_mla_backend(mla_mod))
    lmr.LatentMoERunner._use_fused_path = lambda self: (self._shared_experts is not None
                                                        and not self.moe_config.is_sequence_parallel)
    stand_ins.append("LatentMoERunner._use_fused_path: TP > 1 not asked (world size 1 stands for TP8)")
    stand_ins.append("routed experts: torch.topk + zeros_like (left out, as in the replay); the MoE method's "
                     "process_weights_after_loading not run (no moe_kernel: shared-expert overlap by stream, "
                     "as with TritonExperts and no-EP prepare/finalize)")
    cfg = kimi_config(KimiLinearConfig, experts)
    vc = vllm_config_for(env.get("VLLM_USE_BREAKABLE_CUDAGRAPH") == "1")
    vc.model_config = model_config_stub(cfg, torch)
    # Held for the process's life: set_current_vllm_config is a generator context, and once
    # nothing refers to it its finally clears the current config (the H200 run of 2026-12-03
    # 23:42 built no layer: "Current vLLM config is not set").
    _CONFIG_CONTEXT.append(set_current_vllm_config(vc))
    _CONFIG_CONTEXT[-1].__enter__()
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo" if dry_cpu else "nccl",
                                 distributed_init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}")
    ensure_model_parallel_initialized(1, 1)
    try:
        vc.kernel_config.ir_op_priority.set_default()  # as the worker does (worker_base.py:93)
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        stand_ins.append(f"ir_op_priority.set_default failed: {e!r}")
    return torch, cfg, vc, stand_ins


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", required=True, help="a replayable mode of modes.json (python -m k3lab.decode_step.modes)")
    ap.add_argument("--layers", default="kda,mla,mtp")
    ap.add_argument("--m", default="1,8,16")
    ap.add_argument("--experts", type=int, default=LOCAL["experts"])
    ap.add_argument("--out", required=True, help="folder for model_check_<mode>.json")
    ap.add_argument("--tmp", default="/tmp/k3_model_check")
    ap.add_argument("--dry-cpu", action="store_true", help="build the layers on the CPU only, no run")
    a = ap.parse_args(argv)
    try:
        rec = modes.replayable(a.mode)
    except (modes.UnknownMode, modes.NotReplayable) as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    kind = modes.branches(a.mode, "kda")["capture"]
    os.makedirs(a.out, exist_ok=True)
    a.tmp = os.path.join(a.tmp, a.mode)
    os.makedirs(a.tmp, exist_ok=True)
    t0 = time.time()
    torch, cfg, vc, stand_ins = setup(rec["env"], a.experts, a.dry_cpu)
    from vllm.platforms import current_platform

    res = {"mode": a.mode, "capture": kind, "env": rec["env"], "stand_ins": stand_ins, "layers": {}, "errors": {},
           "capability": str(current_platform.get_device_capability()), "torch": torch.__version__}  # fmt: skip
    torch.set_default_dtype(torch.bfloat16)
    for layer in a.layers.split(","):
        try:
            if a.dry_cpu:
                mod, dec, runner = build(layer, cfg, vc, torch)
                stub_routed_experts(runner, torch)
                label_everything(torch, mod)
                res["layers"][layer] = {"class": type(mod).__name__, "moe_runner": type(runner).__name__,
                                        "fused_path": runner._use_fused_path()}  # fmt: skip
            else:
                with torch.device("cuda"):
                    res["layers"][layer] = check_layer(layer, kind, [int(x) for x in a.m.split(",")], cfg,
                                                       vc, torch, a.tmp)  # fmt: skip
        except Exception:  # noqa: BLE001 - one layer's failure is a result, the others still run
            res["errors"][layer] = traceback.format_exc()[-4000:]
            print(res["errors"][layer], file=sys.stderr)
        print(f"[model_check] {a.mode} {layer} done at {time.time() - t0:.0f}s", flush=True)
        res["wall_s"] = round(time.time() - t0)
        with open(os.path.join(a.out, f"model_check_{a.mode}.json"), "w") as f:  # after each layer:
            json.dump(res, f, indent=1)  # a run stopped by its deadline keeps what it saw
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
