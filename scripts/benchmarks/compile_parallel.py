"""Benchmark case ``compile_parallel``: the engine's step compiled over eager, side by side, for context
parallel (cp 2, the ring attention as one opaque custom operator inside the compiled blocks) and
expert parallel (ep 2 on the MoE debug model: attention, router and shared experts compiled, routing
and all-to-all eager; parallelisms/compile.py), and ep 2 on DeepSeek-V3's debug model (MLA, the
group-limited router and shared experts compiled, its dense block whole). Two processes each,
interleaved rounds, medians of per-step ratios; inductor where a C++ compiler exists, else
aot_eager. Compilation happens in the dropped warm-up steps.
"""

from __future__ import annotations

import os
import shutil

from scripts.benchmarks.harness import interleave, ratio_stat

LAYOUTS = {
    "cp2": {"parallelism.cp": 2, "parallelism.dp_shard": 1},
    "ep2": {"model.name": "moe", "parallelism.dp_shard": 2, "parallelism.ep": 2},
    "deepseek_v3_ep2": {"model.name": "deepseek_v3", "model.flavor": "debugmodel", "parallelism.dp_shard": 2,
                        "parallelism.ep": 2},
}


def case_compile_parallel(b) -> None:
    """Rows: compiled step / eager step for each of :data:`LAYOUTS` (``b``: scripts/benchmark.py's Bench)."""
    backend = "inductor" if shutil.which(os.environ.get("CXX", "g++")) else "aot_eager"
    compiled = {"compile.enable": "true", "compile.backend": backend}
    out = {"backend": backend}
    for name, layout in LAYOUTS.items():
        variants = {}
        for mode, extra in (("eager", {}), ("compiled", compiled)):
            overrides = {**layout, **extra}
            variants[mode] = (lambda o=overrides, n=f"cp_{name}_{mode}": b.timed(n, 2, o, warmup=3)[0]["step_s"])
        samples = interleave(variants, max(2, b.rounds // 2))
        stat = ratio_stat(samples["compiled"], samples["eager"])
        out[name] = {"samples": samples, "compiled_over_eager": stat.as_dict()}
        b.row("compile_parallel", f"{name}: compiled ({backend}) step / eager step",
              f"{stat.median:.3f}x  (p25-p75 {stat.p25:.3f}-{stat.p75:.3f}, n={stat.n})")
    b.results["compile_parallel"] = out
