"""Benchmark case ``muon``: the engine's step with ``optimizer.name = "Muon"`` over the same step with AdamW.

Muon (engine/train/muon.py) adds, per hidden matrix and step, a Newton-Schulz iteration (5 quintic
steps: ~15 matmuls of the matrix's size, in bfloat16 as torch.optim.Muon) and, under FSDP2, a gather
of the whole matrix and a broadcast of the result; AdamW is one fused elementwise pass. Measured as
the whole step (forward, backward, optimizer), interleaved rounds, medians: one process, and FSDP2 on
two processes (where the round-robin owner does each matrix's iteration once). Muon runs twice:
with the default bfloat16 iteration and with ``optimizer.muon_ns_dtype = "float32"``; on a CPU
without bfloat16 matmul units (AVX2) the former emulates every bfloat16 matmul.
"""

from __future__ import annotations

from scripts.benchmarks.harness import interleave, ratio_stat

FSDP2 = {"parallelism.dp_shard": 2}


def case_muon(b) -> None:
    """Rows: Muon step / AdamW step on 1 and on 2 processes (``b``: scripts/benchmark.py's Bench)."""
    out = {}
    for world, layout, label in ((1, {}, "1 process"), (2, FSDP2, "FSDP2, 2 processes")):
        variants = {}
        for name, extra in (("AdamW", {}), ("Muon", {}), ("Muon_ns_float32", {"optimizer.muon_ns_dtype": "float32"})):
            overrides = {**layout, "optimizer.name": name.split("_")[0], **extra}
            variants[name] = (lambda o=overrides, n=name, w=world: [
                t for rank in b.timed(f"muon_{n}_{w}", w, o, independent=w == 1)[:1] for t in rank["step_s"]])
        samples = interleave(variants, max(2, b.rounds // 2))
        out[str(world)] = {"samples": samples}
        for name, what in (("Muon", "Muon"), ("Muon_ns_float32", "Muon (ns float32)")):
            stat = ratio_stat(samples[name], samples["AdamW"])
            out[str(world)][f"{name.lower()}_over_adamw"] = stat.as_dict()
            b.row("muon", f"engine step, {what} / AdamW ({label})",
                  f"{stat.median:.3f}x  (p25-p75 {stat.p25:.3f}-{stat.p75:.3f}, n={stat.n})")
    b.results["muon"] = out
