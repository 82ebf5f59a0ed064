"""The device and kernel rows of scripts/gpu_check.py: versions and device, process-group init,
the memory API, matmul TFLOP/s, flash SDPA and the MoE grouped matmul; one function per check, each
through the engine's own code. The rows' conventions (:class:`Ctx`, :class:`Skip`, the tolerances) and
shared builders are in scripts/gpu_check_common.py; the training rows are in scripts/gpu_check_train.py.
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch
import torch.nn.functional as F

from gpu_check_common import BF16_REL, Ctx, process_group, rel_err


@contextlib.contextmanager
def count_grouped_mm():
    """Count the calls of ``torch._grouped_mm`` made inside the block (the list of input dtypes)."""
    real, calls = torch._grouped_mm, []

    def spy(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    torch._grouped_mm = spy
    try:
        yield calls
    finally:
        torch._grouped_mm = real


def sdpa_ops(fn) -> list[str]:
    """Names of the ``aten::_scaled_dot_product_*`` kernels ``fn()`` dispatched (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product_")})


# ------------------------------------------------------------------------------------ the rows
def row_device(ctx: Ctx) -> dict:
    """torch / CUDA versions and the device's name, compute capability, SMs and memory."""
    out = {"torch": torch.__version__, "cuda": torch.version.cuda or "none"}
    if ctx.dry:
        out["device"] = "cpu (dry run)"
        return out
    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    props = torch.cuda.get_device_properties(0)
    out.update(name=props.name, cc=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
               mem_gib=round(props.total_memory / 2**30, 1), gpus=torch.cuda.device_count())
    return out


def row_init(ctx: Ctx) -> dict:
    """engine.train.distributed.init_distributed at world size 1: cuda:0 with NCCL (gloo on the CPU), one
    all_reduce and a barrier through the group, and the engine's 5-D mesh on that device type."""
    import torch.distributed as dist

    from engine.train.distributed import resolve_backend, resolve_device

    start = time.perf_counter()
    info, dims = process_group(ctx)
    init_s = time.perf_counter() - start
    want_device = torch.device("cpu") if ctx.dry else torch.device("cuda", 0)
    want_backend = "gloo" if ctx.dry else "nccl"
    assert info.device == want_device, f"engine chose {info.device}, expected {want_device}"
    assert info.backend == want_backend == dist.get_backend(), (info.backend, dist.get_backend())
    if not ctx.dry:
        assert resolve_device("auto", 0) == want_device and resolve_backend("auto", want_device) == "nccl"
        assert torch.cuda.current_device() == 0
    value = torch.arange(4, dtype=torch.float32, device=info.device)
    dist.all_reduce(value)
    dist.barrier()
    assert torch.equal(value.cpu(), torch.arange(4, dtype=torch.float32)), value
    mesh = dims.mesh("dp_shard_cp")
    assert mesh.device_type == info.device.type and mesh.size() == 1, mesh
    out = {"backend": info.backend, "device": str(info.device), "init_s": round(init_s, 2)}
    if not ctx.dry:
        version = torch.cuda.nccl.version()  # a tuple (major, minor, patch[, suffix]); an int in old builds
        out["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return out


def row_memory(ctx: Ctx) -> dict:
    """torch.cuda max_memory_allocated / memory_stats / reset_peak_memory_stats around a 512 MiB
    allocation, and engine.observe.metrics.device_memory_stats (GiB) reading and resetting the peak."""
    from engine.observe.metrics import device_memory_stats

    if ctx.dry:
        stats = device_memory_stats(ctx.device)
        assert stats["mem_max_rss_gib"] > 0, stats
        return {"cpu_max_rss_gib": round(stats["mem_max_rss_gib"], 2), "cuda_calls": "skipped (cpu)"}
    dev, size = ctx.device, 512 * 2**20
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    assert torch.cuda.max_memory_allocated(dev) == base, "reset_peak_memory_stats did not reset the peak"
    block = torch.empty(size, dtype=torch.uint8, device=dev)
    peak = torch.cuda.max_memory_allocated(dev)
    assert peak - base >= size, f"peak grew by {peak - base} bytes for a {size}-byte tensor"
    stats = torch.cuda.memory_stats(dev)
    for key in ("allocated_bytes.all.peak", "reserved_bytes.all.current", "num_alloc_retries"):
        assert key in stats, f"memory_stats() lacks {key!r}"
    assert stats["allocated_bytes.all.peak"] == peak, (stats["allocated_bytes.all.peak"], peak)
    del block
    assert torch.cuda.memory_allocated(dev) == base, "freeing the tensor did not lower memory_allocated"
    engine = device_memory_stats(dev, reset=True)
    assert engine["mem_peak_allocated_gib"] >= size / 2**30, engine
    assert torch.cuda.max_memory_allocated(dev) == base, "device_memory_stats(reset=True) kept the peak"
    free, total = torch.cuda.mem_get_info(dev)
    return {"peak_gib": round(engine["mem_peak_allocated_gib"], 3),
            "reserved_gib": round(engine["mem_peak_reserved_gib"], 3),
            "retries": int(engine["mem_alloc_retries"]), "free_gib": round(free / 2**30, 1)}


def row_matmul(ctx: Ctx) -> dict:
    """Dense bf16 matmul rate: n×n×n products (2n³ FLOP each), 10 timed after 3 warm-ups."""
    from engine.observe.flops import get_peak_flops

    n = 256 if ctx.dry else 8192
    a = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ctx.sync()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    ctx.sync()
    tflops = 10 * 2 * n**3 / (time.perf_counter() - start) / 1e12
    ctx.state["matmul_tflops"] = tflops
    peak = None if ctx.dry else get_peak_flops("cuda", None, 0.0)
    out = {"n": n, "tflops": round(tflops, 1)}
    if peak:
        out["of_table_peak_pct"] = round(100 * tflops * 1e12 / peak, 1)
    return out


def row_flash(ctx: Ctx) -> dict:
    """Flash SDPA: forced with sdpa_kernel(FLASH_ATTENTION), the profiler must show the flash
    kernel; causal bf16 output and gradients against fp32 math SDPA; the engine's Attention module
    (RoPE, GQA repeat, [B, H, S, D] layout) runs forward/backward under flash only; and the kernel
    SDPA picks by default for that module is reported. Source: torch.nn.attention.sdpa_kernel docs,
    FlashAttention-2 (Dao 2023, arXiv 2307.08691)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from models.common.args import LlamaModelArgs
    from models.common.decoder import Attention, precompute_rope

    b, h, s, d = (1, 2, 64, 16) if ctx.dry else (2, 16, 2048, 128)
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(b, h, s, d, generator=gen).to(ctx.device) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        ref_out = F.scaled_dot_product_attention(*ref, is_causal=True)
    ref_out.backward(g)
    low = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    out = {}

    def flash_forward_backward():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            result = F.scaled_dot_product_attention(*low, is_causal=True)
            result.backward(g.to(torch.bfloat16))
        out["result"] = result

    ops = sdpa_ops(flash_forward_backward)
    assert any("flash" in op for op in ops), f"flash forced but the profiler saw {ops}"
    errors = {"out": rel_err(out["result"], ref_out)}
    errors.update({f"d{name}": rel_err(t.grad, r.grad) for name, t, r in zip("qkv", low, ref)})
    assert max(errors.values()) < BF16_REL, f"flash vs fp32 math: {errors}"

    args = LlamaModelArgs(dim=h * d, n_layers=1, n_heads=h, n_kv_heads=h // 2, max_seq_len=s)
    attention = Attention(args).to(device=ctx.device, dtype=torch.bfloat16)
    cos, sin = precompute_rope(args.head_dim, s, args.rope_theta, device=ctx.device)
    x = torch.randn(b, s, args.dim, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        attention(x, cos, sin).float().square().mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all(), "non-finite gradient through flash attention"
    default = sdpa_ops(lambda: attention(x, cos, sin))
    return {"shape": f"{b}x{h}x{s}x{d}", "forced": ops[0].removeprefix("aten::_scaled_dot_product_"),
            "model_default": ",".join(op.removeprefix("aten::_scaled_dot_product_") for op in default),
            "max_rel_err": f"{max(errors.values()):.1e}"}


def row_grouped_mm(ctx: Ctx) -> dict:
    """MoE experts on ``torch._grouped_mm``: GroupedExperts in bf16 with uneven groups (one empty,
    none aligned to 16 rows) must call the grouped kernel and match the per-expert loop and an fp32
    loop in output and weight gradients; a whole MoE layer (router, sort, combine) must call it and
    match its loop path. Also times the MoE layer both ways. Source: models/common/moe.py."""
    from models.common.moe_args import MoEModelArgs
    from models.common.moe import MoE, GroupedExperts, _grouped_mm_usable

    if not hasattr(torch, "_grouped_mm"):
        raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm")
    dim, hidden, counts = (64, 32, [0, 5, 17, 2]) if ctx.dry else (1024, 512, [0, 37, 129, 5, 64, 200, 1, 77])
    counts_t = torch.tensor(counts, device=ctx.device)
    experts = GroupedExperts(dim, hidden, len(counts)).to(ctx.device)
    experts.init_weights(0.02, seed=0, prefix="experts")
    gen = torch.Generator().manual_seed(0)
    x32 = torch.randn(sum(counts), dim, generator=gen).to(ctx.device)
    g32 = torch.randn(sum(counts), dim, generator=gen).to(ctx.device)

    def run(module, dtype, grouped):
        module = copy.deepcopy(module).to(dtype)
        module.use_grouped_mm = grouped
        x = x32.to(dtype, copy=True).requires_grad_()
        with count_grouped_mm() as calls:
            y = module(x, counts_t)
            (y.float() * g32).sum().backward()
        return y, [module.w1.grad, module.w2.grad, module.w3.grad, x.grad], len(calls)

    assert _grouped_mm_usable(x32.to(torch.bfloat16), experts.w1.to(torch.bfloat16)), "grouped mm judged unusable"
    y_ref, grads_ref, _ = run(experts, torch.float32, False)
    y_grp, grads_grp, calls = run(experts, torch.bfloat16, True)
    y_loop, grads_loop, loop_calls = run(experts, torch.bfloat16, False)
    assert calls == 3 and loop_calls == 0, f"torch._grouped_mm called {calls} times (grouped), {loop_calls} (loop)"
    errors = {"out": rel_err(y_grp, y_ref), "loop_out": rel_err(y_loop, y_ref)}
    errors.update({f"d{n}": rel_err(a, b) for n, a, b in zip(("w1", "w2", "w3", "x"), grads_grp, grads_ref)})
    assert max(errors.values()) < BF16_REL, f"bf16 vs fp32 loop: {errors}"
    assert all(t[0].abs().sum() == 0 for t in grads_grp[:3]), "the empty expert got a non-zero gradient"

    args = MoEModelArgs(dim=dim, n_layers=1, n_heads=4, num_experts=8, top_k=2, moe_inter_dim=hidden)
    layer = MoE(args).to(ctx.device)
    layer.init_weights(0.02, seed=0, prefix="moe")
    layer = layer.to(torch.bfloat16).eval()  # eval: no routing statistics are accumulated
    tokens = (2, 64) if ctx.dry else (4, 4096)
    x = torch.randn(*tokens, dim, generator=gen).to(ctx.device, torch.bfloat16)
    timings = {}
    for grouped in (True, False):
        layer.experts.use_grouped_mm = grouped
        with torch.no_grad(), count_grouped_mm() as calls:
            out = layer(x)
            ctx.sync()
            start = time.perf_counter()
            for _ in range(5):
                layer(x)
            ctx.sync()
        timings[grouped] = (time.perf_counter() - start) / 5
        assert (len(calls) > 0) == grouped, f"MoE forward (grouped={grouped}) made {len(calls)} grouped calls"
        if grouped:
            grouped_out = out
    layer_err = rel_err(grouped_out, out)
    assert layer_err < BF16_REL, f"MoE layer grouped vs loop: {layer_err:.2e}"
    return {"max_rel_err": f"{max(errors.values()):.1e}", "moe_layer_rel_err": f"{layer_err:.1e}",
            "moe_fwd_ms_grouped": round(timings[True] * 1e3, 2), "moe_fwd_ms_loop": round(timings[False] * 1e3, 2)}
