"""The training rows of scripts/gpu_check.py: a bf16 step under FSDP2's mixed-precision policy,
per-block torch.compile against eager, and the MFU of a LLaMA-3 1B/3B shape.

Each row builds its model the way the engine does (meta model → parallelisms.* → to_empty +
init_weights) and trains on uniform random tokens (no dataset). Conventions as in
scripts/gpu_check_common.py: a row returns ``{name: number}`` or raises.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from gpu_check_common import (
    BF16_REL, Ctx, build_model, mfu_args, process_group, rel_err, small_args, step_loss, synthetic_batch,
)


def _optimizer(model):
    """The engine's AdamW with the config's defaults (engine.train.optimizer.build_optimizer)."""
    from engine.config.schema import OptimizerSection
    from engine.train.optimizer import build_optimizer

    return build_optimizer([model], OptimizerSection())


def _local(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor (FSDP2 parameter or gradient), else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def row_bf16(ctx: Ctx) -> dict:
    """bf16 mixed precision, both ways the engine applies it: FSDP2's MixedPrecisionPolicy
    (parallelisms.data_parallel.apply_fsdp on the 1-rank mesh, as every launched run, one process
    included) and bf16 autocast (engine.train.runner.StepContext, as a Trainer built without
    torchrun). Checks: compute in bf16 (the projections output bf16), fp32 sharded master weights
    and gradients, loss within 2% and the first block's gradient within 5% (relative L2) of the fp32
    model with the same weights, but not equal to it, and an optimizer step that changes the
    weights. Source: torch.distributed.fsdp.MixedPrecisionPolicy docs."""
    from engine.train.runner import StepContext
    from parallelisms.data_parallel import apply_fsdp

    info, dims = process_group(ctx)
    seq, batch = (64, 2) if ctx.dry else (1024, 4)
    args = small_args(ctx, seq)
    inputs, labels = synthetic_batch(args.vocab_size, batch, seq, ctx.device)

    ref = build_model(args, ctx.device)
    loss32 = step_loss(ref, inputs, labels)
    loss32.backward()
    ref_grad = ref.layers["0"].attention.wq.weight.grad

    context = StepContext([ref], ctx.device, context_parallel=None, autocast_bf16=True, loss_parallel=False)
    with torch.no_grad(), context.autocast():
        logits = ref(inputs)
    assert logits.dtype == torch.bfloat16, f"autocast logits are {logits.dtype}"
    from engine.train.loss import token_sum_loss

    loss_autocast = token_sum_loss(logits, labels, float(labels.numel())).item()

    model = build_model(args, ctx.device, parallelize=lambda m: apply_fsdp(
        m, dims.mesh("dp_shard_cp"), param_dtype="bfloat16", reduce_dtype="float32", backend=info.backend))
    seen = []
    model.layers["0"].attention.wq.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    optimizer = _optimizer(model)
    ctx.sync()
    start = time.perf_counter()
    loss = step_loss(model, inputs, labels)
    loss.backward()
    weight = model.layers["0"].attention.wq.weight
    before = _local(weight).detach().clone()
    optimizer.step()
    ctx.sync()
    step_s = time.perf_counter() - start
    assert seen == [torch.bfloat16], f"FSDP2 mixed precision computed wq in {seen}"
    assert type(weight).__name__ == "DTensor" and weight.dtype == torch.float32, (type(weight), weight.dtype)
    assert weight.grad is not None and weight.grad.dtype == torch.float32, "gradient missing or not fp32"
    errors = {"loss_fsdp": rel_err(loss.detach(), loss32.detach()),
              "loss_autocast": abs(loss_autocast - loss32.item()) / abs(loss32.item()),
              "grad_fsdp": rel_err(_local(weight.grad), ref_grad)}
    # The layer-0 gradient comes back through every block in bf16: 9e-3 measured at this width
    # (CPU, seq 256), hence a wider bound than one bf16 op's; a lost scale or dtype gives ~1.
    assert max(errors["loss_fsdp"], errors["loss_autocast"]) < BF16_REL and errors["grad_fsdp"] < 5e-2, errors
    assert errors["loss_fsdp"] > 0, "bf16 loss equals the fp32 loss bit for bit: no mixed precision applied"
    assert not torch.equal(_local(weight).detach(), before), "the optimizer step left the weights unchanged"
    return {"loss_fp32": round(loss32.item(), 4), "loss_fsdp_bf16": round(loss.item(), 4),
            "loss_autocast_bf16": round(loss_autocast, 4), "max_rel_err": f"{max(errors.values()):.1e}",
            "step_s": round(step_s, 3)}


def row_compile(ctx: Ctx) -> dict:
    """Per-block torch.compile (parallelisms.compile.apply_compile, fullgraph=True): every block
    compiled, no graph break, loss and gradients equal to eager in fp32 (relative 1e-3: inductor
    fuses and reorders reductions), and the step times of both. Source: torch.compile docs."""
    import copy

    from parallelisms.compile import apply_compile

    torch._dynamo.reset()  # forget shapes and graphs from earlier rows (no automatic dynamic shapes)
    seq, batch = (64, 2) if ctx.dry else (1024, 4)
    args = small_args(ctx, seq)
    inputs, labels = synthetic_batch(args.vocab_size, batch, seq, ctx.device)
    eager = build_model(args, ctx.device)
    compiled = copy.deepcopy(eager)
    assert apply_compile(compiled) == args.n_layers

    def step(model):
        model.zero_grad(set_to_none=True)
        ctx.sync()
        start = time.perf_counter()
        loss = step_loss(model, inputs, labels)
        loss.backward()
        ctx.sync()
        return loss.detach(), time.perf_counter() - start

    loss_e, _ = step(eager)
    loss_c, first_s = step(compiled)
    grads = {n: p.grad for n, p in eager.named_parameters()}
    worst = max(rel_err(p.grad, grads[n]) for n, p in compiled.named_parameters())
    loss_err = rel_err(loss_c, loss_e)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames >= 1, "no graph was compiled: the blocks ran eagerly"
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    assert breaks == 0, f"{breaks} graph breaks: {dict(torch._dynamo.utils.counters['graph_break'])}"
    assert loss_err < 1e-3 and worst < 1e-3, f"compiled vs eager: loss {loss_err:.2e}, worst gradient {worst:.2e}"
    eager_s = statistics.median(step(eager)[1] for _ in range(3))
    compiled_s = statistics.median(step(compiled)[1] for _ in range(3))
    return {"blocks": args.n_layers, "graphs": frames, "compile_s": round(first_s, 1),
            "loss_rel_err": f"{loss_err:.1e}", "grad_rel_err": f"{worst:.1e}",
            "eager_ms": round(eager_s * 1e3, 1), "compiled_ms": round(compiled_s * 1e3, 1)}


def row_mfu(ctx: Ctx) -> dict:
    """MFU of a LLaMA-3 shape in bf16: per-block compile, then FSDP2 bf16 parameters / fp32
    reduction on the 1-rank mesh (the plan's order), the engine's AdamW and gradient clipping.
    ``warmup`` steps (the first compiles), then up to ``steps`` timed steps (fewer when the row's
    deadline comes first); MFU = FLOPs/token (engine's 6N + 12·L·H·Q·T) × tokens/s / peak
    (engine.observe.flops table: dense bf16 989 TFLOP/s for an H200). Source: PaLM (arXiv 2204.02311) App. B."""
    from engine.observe.flops import compute_mfu, compute_tflops, get_peak_flops
    from models.common.shapes import llama_flops_per_token
    from parallelisms.compile import apply_compile
    from parallelisms.data_parallel import apply_fsdp
    from parallelisms.grad_norm import clip_grad_norm_

    torch._dynamo.reset()
    info, dims = process_group(ctx)
    args = mfu_args(ctx)
    batch, seq = ctx.batch, ctx.seq_len

    def parallelize(model):
        if ctx.compile:
            apply_compile(model)
        apply_fsdp(model, dims.mesh("dp_shard_cp"), param_dtype="bfloat16", reduce_dtype="float32",
                   backend=info.backend)

    start = time.perf_counter()
    model = build_model(args, ctx.device, parallelize=parallelize)
    nparams = sum(p.numel() for p in model.parameters())
    flops_per_token = llama_flops_per_token(args, seq)
    optimizer = _optimizer(model)
    params = list(model.parameters())
    inputs, labels = synthetic_batch(args.vocab_size, batch, seq, ctx.device)
    init_s = time.perf_counter() - start
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    times, losses = [], []
    for i in range(ctx.warmup + ctx.steps):
        ctx.sync()
        t0 = time.perf_counter()
        loss = step_loss(model, inputs, labels)
        loss.backward()
        clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronizes, as the trainer's logging does
        ctx.sync()
        dt = time.perf_counter() - t0
        if i == 0:
            first_s = dt
        if i >= ctx.warmup:
            times.append(dt)
            if time.monotonic() + 2 * dt > ctx.deadline:
                break  # report what was measured rather than lose the row to its time budget
    if not times:
        raise RuntimeError(f"no timed step: warm-up ({ctx.warmup} steps, first {first_s:.0f} s) used the budget")
    assert all(math.isfinite(x) for x in losses), f"non-finite loss: {losses}"
    median = statistics.median(times)
    tokens_per_s = batch * seq / median
    peak = get_peak_flops("cuda", "NVIDIA H200", 0.0) if ctx.dry else get_peak_flops("cuda", None, 0.0)
    mfu = compute_mfu(flops_per_token, tokens_per_s, peak)
    out = {"shape": "tiny(dry)" if ctx.dry else ctx.mfu_shape, "seq": seq, "batch": batch,
           "params_b": round(nparams / 1e9, 3), "init_s": round(init_s, 1), "first_step_s": round(first_s, 1),
           "steps_timed": len(times), "median_step_s": round(median, 4), "tokens_per_s": round(tokens_per_s),
           "tflops": round(compute_tflops(flops_per_token, tokens_per_s), 1),
           "mfu_pct": None if mfu is None else round(mfu, 1)}
    if "matmul_tflops" in ctx.state:
        out["mfu_vs_matmul_pct"] = round(
            100 * compute_tflops(flops_per_token, tokens_per_s) / ctx.state["matmul_tflops"], 1)
    if ctx.device.type == "cuda":
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(ctx.device) / 2**30, 1)
    out["loss_first_last"] = f"{losses[0]:.3f}/{losses[-1]:.3f}"
    return out
