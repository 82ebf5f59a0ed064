#!/usr/bin/env python
"""The engine's performance ratios on the machine at hand: one table, and JSON with every sample.

    python scripts/benchmark.py --quick                 # about 5 minutes on 2 cores
    python scripts/benchmark.py --json bench.json       # more rounds; also writes the JSON
    python scripts/benchmark.py --only loop,scaling     # some cases

Cases (debugmodel, fp32, CPU, gloo; one intra-op thread per rank):
- ``loop``: the engine's step vs a bare PyTorch loop (same model class, weights, tokens, fused AdamW,
  ``clip_grad_norm_``), alternating blocks of steps in one process; and clipping alone: the engine's
  ``clip_grad_norm_`` vs ``torch.nn.utils.clip_grad_norm_`` on the same gradients.
- ``scaling``: tokens/s at W = 2 for FSDP2, DDP and TP over W = 1, divided by the machine's
  2-process ceiling (two independent one-process runs at once over one alone); runs interleaved by
  round; and TP 2 compiled without sequence parallel over one compiled process. Also the engine's
  clipping under TP 2 vs ``torch.nn.utils.clip_grad_norm_`` on full-size
  copies of the same gradients (the one-process clip), alternating in the same rank process.
- ``comm``: collective bytes per rank per step, counted by a dispatch mode
  (parallelisms/comm_counter.py), against the exact formulas; also FSDP with 2 microbatches,
  reducing after each microbatch or only after the last (``parallelism.grad_sync_each_microbatch``).
- ``memory``: per-rank parameter + gradient + optimizer bytes under FSDP2 at W = 2 over W = 1 (1/W
  expected); and the unsharded bytes FSDP holds between microbatches with
  ``grad_sync_each_microbatch`` true / false (the memory price of one reduction per step).
- ``ac_compile``: step time with activation checkpointing (full, selective "op", selective
  "op_all_matmuls") and with compile (inductor where a C++ compiler exists, else aot_eager), over
  eager without AC; and the peak activation bytes of one step under each AC option (MemTracker,
  exact: bytes do not vary between runs), over no AC.
- ``document_mask``: block-causal attention over packed documents (``[document_mask]``) vs plain
  causal: attention alone (forward + backward at the debug shape, scripts/benchmarks/attention.py),
  and the engine's step with ``document_mask.enable`` on vs off, interleaved.
- ``loss``: the fused, chunked linear cross entropy (``[loss] chunk_tokens``, its default) against the
  unfused loss over full logits (``loss.chunk_tokens = 0``) at debugmodel's layers with Llama 3's
  vocabulary (128,256) and one sequence of 2048 tokens (scripts/benchmarks/loss.py): peak bytes of
  the loss phase (forward + backward of output projection and loss, torch's ``MemTracker``), unfused
  over fused; and engine step time, fused over unfused, interleaved rounds.
- ``data``: prepared data (scripts/benchmarks/data.py): synthetic prepared corpora of 10^7 and 10^9
  tokens (2 GB, written and deleted here); time to the first batch and resident memory added by
  the loader in a fresh process, resume at window 10^8 vs 0, the loader's tokens/s over the debug
  model's; the bundled raw corpus's start-up for comparison; the one-time checksum verification of
  a set's first start (later starts trust the record, as every start-up sample here does).
- ``muon``: the engine's step with Muon over the same step with AdamW, 1 process and FSDP2 on 2
  (scripts/benchmarks/optimizers.py).
- ``compile_parallel``: compiled over eager step time, cp 2, ep 2 and DeepSeek-V3 ep 2 side by side
  (scripts/benchmarks/compile_parallel.py).
- ``data_prepare`` (optional: ``--only data_prepare``): scripts/prepare_data.py's preparation of the
  bundled corpus repeated 8 times (11.6M tokens, one jsonl, its Arrow conversion included) with
  ``--num_proc`` 1 and 2, interleaved, each in a fresh process; the speed-up of 2 over 1.

Discipline (scripts/benchmarks/harness.py): refuses to start a case while other processes use more
than ``--max-load`` of the cores, drops warm-up steps, interleaves variants, reports medians with the
inter-quartile spread. Not part of the test suite (minutes, and machine-dependent).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from scripts.project_env import use_project_python  # noqa: E402

use_project_python()  # the system Python of a fresh machine lacks torch: re-run under .venv's
os.environ.setdefault("OMP_NUM_THREADS", "1")

from scripts.benchmarks import runs  # noqa: E402
from scripts.benchmarks.harness import MachineBusyError, Stat, guard_load, interleave, ratio_stat  # noqa: E402
from scripts.benchmarks.compile_parallel import case_compile_parallel  # noqa: E402,F401  (found by name)
from scripts.benchmarks.optimizers import case_muon  # noqa: E402,F401  (found by name in main)
from scripts.benchmarks.data_cases import case_data, case_data_prepare  # noqa: E402,F401  (found by name)
from engine.testing.processes import run_distributed  # noqa: E402

CASES = ("loop", "scaling", "comm", "memory", "ac_compile", "document_mask", "loss", "data", "muon",
         "compile_parallel")
OPTIONAL_CASES = ("data_prepare",)  # run only when named in --only
FSDP2 = {"parallelism.dp_shard": 2}
DDP2 = {"parallelism.dp_replicate": 2, "parallelism.dp_shard": 1}
TP2 = {"parallelism.tp": 2, "parallelism.dp_shard": 1}
COMPILED = {"compile.enable": "true"}
# TP 2 compiled, without sequence parallel: compile traces DTensor's dispatch away, and on gloo one
# all-reduce costs less than the all-gather + reduce-scatter pair that sequence parallel uses.
TP2_COMPILED = {**TP2, **COMPILED, "parallelism.sequence_parallel": "false"}


class Bench:
    """Shared settings of one benchmark invocation and its collected rows / JSON."""

    def __init__(self, args):
        self.quick = args.quick
        self.rounds = 2 if args.quick else 6
        self.steps = 3 if args.quick else 5
        self.warmup = 2
        self.seq_len, self.local_batch_size = args.seq_len, args.local_batch_size
        self.max_load = args.max_load
        self.folder = tempfile.mkdtemp(prefix="quadra_bench_")
        self.rows: list[tuple[str, str, str]] = []  # (case, what, value)
        self.results: dict = {"settings": {"seq_len": self.seq_len, "local_batch_size": self.local_batch_size,
                                           "rounds": self.rounds, "steps": self.steps, "quick": self.quick},
                              "load": {}}

    def argv(self, name: str, overrides: dict) -> list[str]:
        return runs.engine_args(os.path.join(self.folder, name), overrides, seq_len=self.seq_len,
                                local_batch_size=self.local_batch_size)

    def row(self, case: str, what: str, value: str) -> None:
        self.rows.append((case, what, value))
        print(f"  {what:<58} {value}", flush=True)

    def timed(self, name: str, world_size: int, overrides: dict, *, independent: bool = False,
              timing: bool = True, warmup: int | None = None, **options):
        """Per-rank results of ``runs.timed_engine_run`` (``independent``: one-process runs side by
        side, no process group); ``options``: count_comm, state_bytes. ``timing=False``: only what
        ``options`` ask for, after one step (FSDP's lazy set-up and the optimizer state are in place)."""
        steps, warmup = (self.steps, warmup or self.warmup) if timing else (0, 1)
        return run_distributed(_timed_with_options, world_size, self.argv(name, overrides), steps,
                               warmup, options, timeout=600, torchrun_env=not independent)


def _timed_with_options(argv, steps, warmup, options):
    return runs.timed_engine_run(argv, steps, warmup, **options)


def _fmt_ratio(stat: Stat) -> str:
    return f"{stat.median:.3f}x  (p25-p75 {stat.p25:.3f}-{stat.p75:.3f}, n={stat.n})"


def case_loop(b: Bench) -> None:
    result = run_distributed(runs.engine_vs_bare_loop, 1, b.argv("loop", {}), b.rounds * 2, b.steps, b.warmup,
                             torchrun_env=False, timeout=900)[0]
    step = ratio_stat(result["engine_s"], result["bare_s"])
    clip = ratio_stat(result["clip_ours_s"], result["clip_torch_s"])
    b.results["loop"] = {**result, "engine_over_bare": step.as_dict(), "clip_ours_over_torch": clip.as_dict()}
    b.row("loop", "engine step / bare PyTorch loop (1 process)", _fmt_ratio(step))
    b.row("loop", "engine clip_grad_norm_ / torch's (1 process)", _fmt_ratio(clip))


def case_scaling(b: Bench) -> None:
    variants = {
        "single": lambda: b.timed("single", 1, {}, independent=True)[0]["step_s"],
        "ceiling": lambda: [t for rank in b.timed("ceiling", 2, {}, independent=True) for t in rank["step_s"]],
        "fsdp2": lambda: b.timed("fsdp2", 2, FSDP2)[0]["step_s"],
        "ddp2": lambda: b.timed("ddp2", 2, DDP2)[0]["step_s"],
        "tp2": lambda: b.timed("tp2", 2, TP2)[0]["step_s"],
        # Compiled (warm-up 3: the first steps compile): TP 2 over one compiled process.
        "single_compiled": lambda: b.timed("single_compiled", 1, COMPILED, independent=True, warmup=3)[0]["step_s"],
        "tp2_compiled": lambda: b.timed("tp2_compiled", 2, TP2_COMPILED, warmup=3)[0]["step_s"],
    }
    samples = interleave(variants, b.rounds)
    single = Stat.of(samples["single"]).median
    # Tokens per step: dp layouts process 2 local batches, TP and a single process 1.
    ceiling = 2 * single / Stat.of(samples["ceiling"]).median
    out = {"samples": samples, "ceiling": ceiling}
    b.row("scaling", "2-process ceiling (2 independent runs / 1 alone)", f"{ceiling:.3f}x")
    for name, tokens_factor in (("fsdp2", 2), ("ddp2", 2), ("tp2", 1)):
        speedup = ratio_stat(samples["single"], samples[name])
        speedup.median *= tokens_factor
        speedup.p25 *= tokens_factor
        speedup.p75 *= tokens_factor
        out[name] = {"speedup": speedup.as_dict(), "of_ceiling": speedup.median / ceiling}
        b.row("scaling", f"{name}: tokens/s over 1 process",
              f"{_fmt_ratio(speedup)}  = {speedup.median / ceiling:.0%} of ceiling")
    compiled = ratio_stat(samples["single_compiled"], samples["tp2_compiled"])
    out["tp2_compiled"] = {"speedup": compiled.as_dict(), "of_ceiling": compiled.median / ceiling}
    b.row("scaling", "tp2 compiled, no SP: tokens/s over 1 compiled process",
          f"{_fmt_ratio(compiled)}  = {compiled.median / ceiling:.0%} of ceiling")
    tp_clip = run_distributed(runs.clip_under_layout, 2, b.argv("tp2_clip", TP2), b.rounds * b.steps * 4,
                              timeout=600)[0]
    out["tp2_clip_s"], out["torch_full_clip_s"] = tp_clip["clip_s"], tp_clip["torch_full_clip_s"]
    b.results["scaling"] = out
    b.row("scaling", "engine clip under TP 2 / torch's clip of the full gradients",
          _fmt_ratio(ratio_stat(tp_clip["clip_s"], tp_clip["torch_full_clip_s"])))


def _fsdp_formula(param_bytes: int, block_bytes: int, n_layers: int, microbatches: int, sync_each: bool) -> dict:
    """FSDP2 bytes per rank per step (payload): every unit all-gathers its weights in forward and,
    when resharded after forward (every block but the last; the root keeps them), again in backward;
    gradients are reduce-scattered once per reduction."""
    gathers = param_bytes + (n_layers - 1) * block_bytes
    if sync_each:
        return {"all_gather": microbatches * gathers, "reduce_scatter": microbatches * param_bytes}
    return {"all_gather": param_bytes, "reduce_scatter": param_bytes}


def case_comm(b: Bench) -> None:
    out = {}
    accum2 = {**FSDP2, "training.local_batch_size": b.local_batch_size // 2,
              "training.global_batch_size": 2 * b.local_batch_size}
    sync_last = {**accum2, "parallelism.grad_sync_each_microbatch": "false"}
    for name, world, overrides in (("fsdp2", 2, FSDP2), ("ddp2", 2, DDP2), ("tp2", 2, TP2),
                                   ("fsdp2_accum2_each", 2, accum2), ("fsdp2_accum2_last", 2, sync_last)):
        r = b.timed(f"comm_{name}", world, overrides, timing=False, count_comm=True)[0]
        comm, P, Pb, L = r["comm"], r["param_bytes"], r["block_bytes"], r["model_args"]["n_layers"]
        D = r["model_args"]["dim"]
        if name.startswith("fsdp2"):
            micro = 2 if "accum2" in name else 1
            want = _fsdp_formula(P, Pb, L, micro, sync_each=not name.endswith("last"))
            got = {k: comm.get(f"dp_shard_cp:{k}", 0) + comm.get(f"dp_shard:{k}", 0) for k in want}
        elif name == "ddp2":
            want = {"all_reduce": P + 8}  # the gradients, and the step's token count and loss sum (fp32)
            got = {"all_reduce": comm.get("dp_replicate:all_reduce", 0)}
        else:
            # Sequence parallel: per block 2 all-gathers + 2 reduce-scatters of [B, S, D] in forward and
            # as many in backward; the embedding (reduce-scatter / all-gather) and the output layer
            # (all-gather / reduce-scatter) add 2 each. fp32 activations.
            act = b.local_batch_size * b.seq_len * D * 4
            want = {"all_gather+reduce_scatter": (8 * L + 4) * act}
            got = {"all_gather+reduce_scatter": comm.get("tp:all_gather", 0) + comm.get("tp:reduce_scatter", 0)}
        out[name] = {"counted": comm, "formula": want, "compared": got}
        for key in want:
            ratio = got[key] / want[key] if want[key] else float("nan")
            b.row("comm", f"{name} {key} bytes/rank/step counted / formula",
                  f"{got[key]:,} / {want[key]:,} = {ratio:.4f}")
    b.results["comm"] = out


def case_memory(b: Bench) -> None:
    single = b.timed("mem1", 1, {}, independent=True, timing=False, state_bytes=True)[0]["state"]
    sharded = b.timed("mem_fsdp2", 2, FSDP2, timing=False, state_bytes=True)
    out = {"single": single, "fsdp2": [r["state"] for r in sharded]}
    for kind in ("params", "grads", "optimizer"):
        ratio = max(r["state"][kind] for r in sharded) / single[kind]
        b.row("memory", f"FSDP2 W=2 {kind} bytes per rank / W=1", f"{ratio:.4f}  (1/W = 0.5)")
    held = run_distributed(runs.held_between_microbatches, 2, b.argv("mem_held", FSDP2), timeout=600)[0]
    out["held_after_microbatch_1"] = held
    # Held over the step: the unsharded fp32 parameters and gradients, 2·P bytes for P parameter bytes.
    b.row("memory", "held between microbatches, sync each / sync last",
          f"{held['each'] / 2**20:.1f} / {held['last'] / 2**20:.1f} MiB "
          f"(2*P = {2 * held['param_bytes'] / 2**20:.1f} MiB)")
    b.results["memory"] = out


def case_ac_compile(b: Bench) -> None:
    backend = "inductor" if shutil.which(os.environ.get("CXX", "g++")) else "aot_eager"
    ac = {"eager": {}, "ac_full": {"activation_checkpoint.mode": "full"},
          "ac_selective_op": {"activation_checkpoint.mode": "selective"},
          "ac_selective_op_all_matmuls": {"activation_checkpoint.mode": "selective",
                                          "activation_checkpoint.selective_ac_option": "op_all_matmuls"}}
    variants = {**ac, f"compile_{backend}": {"compile.enable": "true", "compile.backend": backend}}
    samples = interleave({name: (lambda o=o, n=name: b.timed(n, 1, o, independent=True)[0]["step_s"])
                          for name, o in variants.items()}, max(2, b.rounds // 2))
    out = {"samples": samples, "activation_peak_bytes": {}}
    for name in variants:
        if name != "eager":
            stat = ratio_stat(samples[name], samples["eager"])
            out[name] = stat.as_dict()
            b.row("ac_compile", f"{name} step / eager", _fmt_ratio(stat))
    peaks = out["activation_peak_bytes"]
    for name, overrides in ac.items():
        peaks[name] = b.timed(f"{name}_mem", 1, overrides, independent=True, timing=False,
                              activation_peak=True)[0]["activation_peak_bytes"]
    for name in ac:
        b.row("ac_compile", f"{name} peak activation bytes (MiB, / eager)",
              f"{peaks[name] / 2**20:.2f}  ({peaks[name] / peaks['eager']:.3f}x)")
    b.results["ac_compile"] = out


def case_document_mask(b: Bench) -> None:
    from scripts.benchmarks.attention import attention_step_seconds

    alone = attention_step_seconds(b.local_batch_size, b.seq_len, max(2, b.rounds))
    variants = {"plain": {}, "masked": {"document_mask.enable": "true"}}
    steps = interleave({name: (lambda o=o, n=name: b.timed(f"dm_{n}", 1, o, independent=True)[0]["step_s"])
                        for name, o in variants.items()}, max(2, b.rounds // 2))
    attention, step = ratio_stat(alone["masked"], alone["causal"]), ratio_stat(steps["masked"], steps["plain"])
    b.results["document_mask"] = {"attention": alone, "steps": steps, "attention_ratio": attention.as_dict(),
                                  "step_ratio": step.as_dict()}
    b.row("document_mask", "block-causal attention fwd+bwd / causal SDPA (debug shape)", _fmt_ratio(attention))
    b.row("document_mask", "engine step, document_mask.enable / off", _fmt_ratio(step))


def case_loss(b: Bench) -> None:
    from engine.config.schema import LossSection
    from scripts.benchmarks import loss

    chunk = LossSection().chunk_tokens
    peaks = {c: run_distributed(loss.loss_phase_peak_bytes, 1, c, torchrun_env=False, timeout=900)[0]
             for c in (0, chunk)}
    variants = {name: (lambda n=name, c=c: b.timed(n, 1, loss.engine_overrides(c), independent=True)[0]["step_s"])
                for name, c in (("unfused", 0), ("fused", chunk))}
    samples = interleave(variants, max(2, b.rounds // 2))
    step = ratio_stat(samples["fused"], samples["unfused"])
    b.results["loss"] = {"chunk_tokens": chunk, "loss_phase_peak_bytes": peaks, "samples": samples,
                         "fused_over_unfused": step.as_dict()}
    peak_row = f"loss phase peak bytes, unfused / fused (chunk {chunk}), vocab {loss.VOCAB:,}, {loss.SEQ_LEN} tokens"
    b.row("loss", peak_row,
          f"{peaks[0] / 2**20:,.0f} / {peaks[chunk] / 2**20:,.0f} MiB = {peaks[0] / peaks[chunk]:.1f}x")
    b.row("loss", f"step time fused / unfused (debugmodel layers, vocab {loss.VOCAB:,}, seq {loss.SEQ_LEN})",
          _fmt_ratio(step))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds: about 5 minutes on 2 cores")
    parser.add_argument("--json", help="write every sample and ratio here")
    parser.add_argument("--only", default=",".join(CASES),
                        help=f"comma-separated cases of {','.join(CASES + OPTIONAL_CASES)} (default: all but "
                             f"{','.join(OPTIONAL_CASES)})")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--local_batch_size", type=int, default=4)
    parser.add_argument("--max-load", type=float, default=0.25,
                        help="refuse to measure while other processes use more than this fraction of the cores")
    args = parser.parse_args(argv)
    cases = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = sorted(set(cases) - set(CASES + OPTIONAL_CASES))
    if unknown:
        parser.error(f"--only: unknown case(s) {unknown}; choose from {','.join(CASES + OPTIONAL_CASES)}")
    import engine.train.trainer  # noqa: F401 - imported once; the forked ranks inherit it

    bench = Bench(args)
    try:
        for case in cases:
            bench.results["load"][case] = guard_load(args.max_load, f"case {case}")
            print(f"[{case}] (other load {bench.results['load'][case]:.0%})", flush=True)
            globals()[f"case_{case}"](bench)
    except MachineBusyError as error:
        print(f"benchmark refused: {error}", file=sys.stderr)
        return 3
    finally:
        shutil.rmtree(bench.folder, ignore_errors=True)
    print("\n| case | measurement | value |\n| --- | --- | --- |")
    for case, what, value in bench.rows:
        print(f"| {case} | {what} | {value} |")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(bench.results, file, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
