"""The float8 row of scripts/gpu_check.py: torchao float8 linears (parallelisms/float8.py) against bf16
at the same shape, both compiled per block and under FSDP2's bf16 policy on the 1-rank mesh.

Checks: 50 steps of each (dry: 5) from the same weights on the same batches, interleaved step by step
so both see the same machine state; no non-finite loss; the float8 loss within :data:`LOSS_REL` of
bf16's, as the mean over the last 10 steps (float8 e4m3 keeps 3 mantissa bits to bf16's 7, so single
steps wander, but a wrong scale (a lost amax, a scale from the wrong tensor) moves the loss by far
more); and the step time of each as medians after the compiling warm-up, with their ratio
(bf16 / float8: above 1 means float8 is faster). Needs a GPU of compute capability 8.9 or newer
(``torch._scaled_mm``'s float8 kernels) and torchao (``pip install -e ".[float8]"``).
Source of the method: torchao/float8/README.md; Micikevicius et al. 2022 (arXiv 2209.05433).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from gpu_check_common import Ctx, Skip, build_model, process_group, step_loss, synthetic_batch

LOSS_REL = 2e-2  # float8 vs bf16 loss, relative, mean of the last 10 steps (module docstring)


def _args(ctx: Ctx, seq: int):
    """LLaMA shape of the row: 8 blocks of width 2048, SwiGLU 8192 (GEMMs float8 gains on); dry: tiny."""
    from models.common.args import LlamaModelArgs

    if ctx.dry:
        return LlamaModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=seq)
    return LlamaModelArgs(dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, vocab_size=32768, multiple_of=256,
                          ffn_dim_multiplier=1.5, max_seq_len=seq)


def row_float8(ctx: Ctx) -> dict:
    """float8 (tensorwise, torchao) vs bf16: loss and step time (module docstring)."""
    from engine.config.schema import OptimizerSection
    from engine.config.schema_scale import Float8Section
    from engine.train.optimizer import build_optimizer
    from parallelisms.compile import apply_compile
    from parallelisms.data_parallel import apply_fsdp
    from parallelisms.float8 import convert_to_float8, torchao_float8

    try:
        torchao_float8()  # imported with its import-time warnings silenced
    except ImportError as err:
        raise Skip(f'torchao is not installed (pip install -e ".[float8]"): {err}')
    if ctx.device.type == "cuda" and torch.cuda.get_device_capability(ctx.device) < (8, 9):
        raise Skip(f"compute capability {torch.cuda.get_device_capability(ctx.device)} has no float8 matmul")
    torch._dynamo.reset()
    info, dims = process_group(ctx)
    seq, batch, steps = (64, 2, 5) if ctx.dry else (2048, 4, 50)
    args = _args(ctx, seq)
    use_compile = ctx.compile and not ctx.dry  # inductor's CPU build of every block would take minutes

    def parallelize(float8: bool):
        def apply(model):
            if float8:
                convert_to_float8(model, Float8Section(enable=True))
            if use_compile:
                apply_compile(model)
            apply_fsdp(model, dims.mesh("dp_shard_cp"), param_dtype="bfloat16", reduce_dtype="float32",
                       backend=info.backend)
        return apply

    models = {name: build_model(args, ctx.device, parallelize=parallelize(name == "float8"))
              for name in ("bf16", "float8")}
    optimizers = {name: build_optimizer([m], OptimizerSection()) for name, m in models.items()}
    losses, times = {name: [] for name in models}, {name: [] for name in models}
    for step in range(steps):
        inputs, labels = synthetic_batch(args.vocab_size, batch, seq, ctx.device, seed=step)
        for name, model in models.items():  # interleaved: the same batch, one after the other
            ctx.sync()
            start = time.perf_counter()
            loss = step_loss(model, inputs, labels)
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            losses[name].append(loss.item())
            ctx.sync()
            times[name].append(time.perf_counter() - start)
        if time.monotonic() > ctx.deadline - 10:
            break
    for name, values in losses.items():
        assert all(math.isfinite(v) for v in values), f"{name}: non-finite loss {values}"
    tail = min(10, len(losses["bf16"]))
    mean = {name: statistics.fmean(values[-tail:]) for name, values in losses.items()}
    rel = abs(mean["float8"] - mean["bf16"]) / abs(mean["bf16"])
    assert rel < LOSS_REL, f"float8 loss {mean['float8']:.4f} vs bf16 {mean['bf16']:.4f} (relative {rel:.1e})"
    warm = min(5, len(times["bf16"]) - 1) if not ctx.dry else 1
    median = {name: statistics.median(values[warm:]) for name, values in times.items()}
    return {"steps": len(losses["bf16"]), "compile": use_compile, "shape": "tiny(dry)" if ctx.dry else "2048x8",
            "loss_bf16": round(mean["bf16"], 4), "loss_float8": round(mean["float8"], 4), "loss_rel": f"{rel:.1e}",
            "bf16_ms": round(median["bf16"] * 1e3, 1), "float8_ms": round(median["float8"] * 1e3, 1),
            "speedup": round(median["bf16"] / median["float8"], 3)}
