"""One-shot check of the engine on one GPU: each row one feature, one table, optional JSON.

    bash scripts/gpu_check.sh                 # one GPU: about 2 minutes on an H200 (106 s, 112 s)
    bash scripts/gpu_check.sh --quick         # MFU on the 1B shape at seq 4096, 5 timed steps
    bash scripts/gpu_check.sh --dry-cpu       # here, without a GPU: every row's code at a tiny shape

Rows, in order (each has its own time budget; a failing or slow row never stops the others):

    device             torch and CUDA versions, GPU name, compute capability, memory
    cuda_nccl_init     engine.train.distributed.init_distributed at world size 1: cuda:0, NCCL, the 5-D mesh
    memory_api         torch.cuda.max_memory_allocated / memory_stats / reset, engine.observe.metrics' reader
    matmul_peak        measured dense bf16 matmul TFLOP/s (context for MFU)
    flash_sdpa         flash SDPA forced, seen in the profiler, vs fp32 math; the model's attention on it
    grouped_mm_moe     MoE experts on torch._grouped_mm vs the per-expert loop, bf16 vs fp32
    bf16_fsdp_step     FSDP2 bf16 MixedPrecisionPolicy and bf16 autocast vs fp32
    compile_per_block  per-block torch.compile vs eager (fp32), no graph break
    mfu_llama3         LLaMA-3.2 3B (or 1B) shape, bf16 + compile + FSDP2: median step, tokens/s, MFU
    float8_step        torchao float8 linears vs bf16, compiled, 50 interleaved steps: loss, step-time ratio

Output: one table on stdout; the same as JSON in ``--json PATH``, else ``$OUT/gpu_check.json`` when
``$OUT`` is set (rewritten after every row, so a killed run leaves the rows it finished). Exit
status 0 when no row failed, 1 otherwise, 124 when stopped by SIGTERM (the wrapper's timeout).

Tokens are synthetic (uniform random ids): no dataset, tokenizer or network is needed, and the
imports avoid ``datasets``, ``sentencepiece`` and ``tensorboard``.

Torch versions: written for the GPU machine's torch 2.11 (CUDA 13) and the project's 2.13. The
--dry-cpu run passes on both without a GPU (torch 2.11.0+cu130 from PyPI and 2.13.0+cpu, with
datasets, sentencepiece and tensorboard absent); nothing in these files needs 2.13. What no CPU run
reaches: NCCL, the CUDA flash and grouped-mm kernels (and the 16-row group padding in front of the
latter), torch.cuda's memory statistics, inductor's GPU code, and the 1B/3B shapes' memory and time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # keep the profiler's start/stop lines out of the table's output
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.dirname(os.path.abspath(__file__))]  # the engine, then the row modules

# (name, module, function, time budget in seconds on a GPU)
ROWS = (
    ("device", "gpu_check_rows", "row_device", 60),
    ("cuda_nccl_init", "gpu_check_rows", "row_init", 90),
    ("memory_api", "gpu_check_rows", "row_memory", 30),
    ("matmul_peak", "gpu_check_rows", "row_matmul", 30),
    ("flash_sdpa", "gpu_check_rows", "row_flash", 60),
    ("grouped_mm_moe", "gpu_check_rows", "row_grouped_mm", 90),
    ("bf16_fsdp_step", "gpu_check_train", "row_bf16", 90),
    ("compile_per_block", "gpu_check_train", "row_compile", 180),
    ("ring_kernels_compile_cp", "gpu_check_longctx", "row_ring_kernels", 150),
    ("compile_moe", "gpu_check_longctx", "row_compile_moe", 150),
    ("mfu_llama3", "gpu_check_train", "row_mfu", 330),
    ("float8_step", "gpu_check_float8", "row_float8", 240),
)
ROW_NAMES = [row[0] for row in ROWS]
DRY_SLOWDOWN = 4  # CPU row budgets are this many times the GPU ones


class RowTimeout(BaseException):
    """The row's budget ran out (SIGALRM). A BaseException, so library code catching Exception
    cannot swallow it."""


class Terminated(BaseException):
    """SIGTERM, e.g. from the wrapper's ``timeout``."""


def _raise(kind):
    def handler(signum, frame):
        raise kind(f"signal {signal.Signals(signum).name}")
    return handler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-cpu", action="store_true", help="run every row's code on the CPU at tiny shapes")
    p.add_argument("--quick", action="store_true", help="MFU on the 1B shape, seq 4096 x 2, 5 timed steps")
    p.add_argument("--json", help="write the results here (default: $OUT/gpu_check.json when $OUT is set)")
    p.add_argument("--only", help=f"comma-separated rows to run, of: {','.join(ROW_NAMES)}")
    p.add_argument("--skip", help="comma-separated rows to leave out")
    p.add_argument("--budget", type=float, help="seconds for all rows (default 450; 1800 with --dry-cpu)")
    p.add_argument("--mfu-shape", choices=("1B", "3B"), help="LLaMA-3.2 shape of the MFU row (default 3B)")
    p.add_argument("--seq-len", type=int, help="MFU tokens per sequence (default 8192; quick 4096)")
    p.add_argument("--batch", type=int, help="MFU sequences per step (default 1; quick 2)")
    p.add_argument("--steps", type=int, help="MFU timed steps (default 10; quick 5)")
    p.add_argument("--warmup", type=int, help="MFU untimed steps first (default 3; quick 2)")
    p.add_argument("--no-compile", action="store_true", help="MFU row in eager mode")
    p.add_argument("--report", metavar="JSON", help="print the table of an earlier run's JSON and exit")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # rows re-run in a fresh process
    p.add_argument("--matmul-tflops", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for flag in ("only", "skip"):
        names = [n for n in (getattr(args, flag) or "").split(",") if n]
        unknown = sorted(set(names) - set(ROW_NAMES))
        if unknown:
            p.error(f"--{flag}: unknown rows {unknown}; rows are {','.join(ROW_NAMES)}")
        setattr(args, flag, names)
    return args


def make_ctx(args):
    """The rows' Ctx from the command line (defaults per mode: full, --quick, --dry-cpu)."""
    import torch

    from gpu_check_common import Ctx

    if args.dry_cpu:
        defaults = dict(mfu_shape="3B", seq_len=64, batch=2, steps=3, warmup=1)
    elif args.quick:
        defaults = dict(mfu_shape="1B", seq_len=4096, batch=2, steps=5, warmup=2)
    else:
        defaults = dict(mfu_shape="3B", seq_len=8192, batch=1, steps=10, warmup=3)
    for key in defaults:
        if getattr(args, key) is not None:
            defaults[key] = getattr(args, key)
    device = torch.device("cpu") if args.dry_cpu else torch.device("cuda", 0)
    ctx = Ctx(device=device, dry=args.dry_cpu, quick=args.quick, compile=not args.no_compile, **defaults)
    if args.matmul_tflops:
        ctx.state["matmul_tflops"] = args.matmul_tflops
    return ctx


def json_path(args) -> str | None:
    if args.json:
        return args.json
    return os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None


def write_json(path: str | None, report: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(report, fh, indent=1)
    os.replace(tmp, path)


def format_table(report: dict) -> str:
    """The results as one fixed-width table: row, status, seconds, numbers or the failure reason."""
    rows = report["rows"]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "FAIL", "skip")}
    head = (f"GPU check ({report['mode']}): torch {report['torch']}, {report.get('device_name', '?')}; "
            f"{counts['ok']} ok, {counts['FAIL']} FAIL, {counts['skip']} skip; {report['seconds']:.0f} s"
            + ("" if report.get("complete", True) else "; INCOMPLETE"))
    lines = [head, f"{'row':<18} {'status':<6} {'secs':>6}  numbers / reason"]
    for r in rows:
        text = r["reason"] if r["status"] != "ok" else " ".join(f"{k}={v}" for k, v in r["numbers"].items())
        lines.append(f"{r['name']:<18} {r['status']:<6} {r['seconds']:>6.1f}  {text}")
    return "\n".join(lines)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or "(no message)"
    return f"{type(error).__name__}: {text}"[:300]


def _cuda_healthy(ctx) -> bool:
    """A tiny kernel still runs: a failed row did not leave a sticky CUDA error behind."""
    import torch

    if ctx.device.type != "cuda":
        return True
    try:
        return torch.ones(1, device=ctx.device).add_(1).item() == 2.0
    except Exception:  # noqa: BLE001 - any error means the context is unusable
        return False


def _forwarded(args) -> list[str]:
    """The command-line settings a child process needs to run rows as this one would."""
    out = [flag for flag, on in (("--dry-cpu", args.dry_cpu), ("--quick", args.quick),
                                 ("--no-compile", args.no_compile)) if on]
    for key in ("mfu_shape", "seq_len", "batch", "steps", "warmup"):
        if getattr(args, key) is not None:
            out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return out


def _run_in_child(args, names: list[str], seconds: float, ctx) -> list[dict]:
    """Run ``names`` in a fresh process, after a row left this one's CUDA context unusable (a
    sticky error such as an illegal memory access fails every later kernel)."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rows.json")
        cmd = [sys.executable, os.path.abspath(__file__), *_forwarded(args), "--child", "--only", ",".join(names),
               "--json", out, "--budget", str(int(seconds))]
        if "matmul_tflops" in ctx.state:
            cmd += ["--matmul-tflops", str(ctx.state["matmul_tflops"])]
        # A process group of its own: without this process's torchrun variables and store port.
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT")}
        try:
            subprocess.run(cmd, timeout=seconds + 60, check=False, env=env)
        except subprocess.TimeoutExpired:
            pass
        if os.path.exists(out):
            with open(out) as fh:
                return json.load(fh)["rows"]
    return [{"name": n, "status": "FAIL", "seconds": 0.0, "numbers": {}, "reason": "child process gave no result"}
            for n in names]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        with open(args.report) as fh:
            print(format_table(json.load(fh)))
        return 0
    start = time.monotonic()
    previous = {sig: signal.signal(sig, _raise(kind)) for sig, kind in
                ((signal.SIGALRM, RowTimeout), (signal.SIGTERM, Terminated))}
    try:
        return _run(args, start)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _device_name(args) -> str:
    import torch

    if args.dry_cpu:
        return "cpu"
    try:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    except Exception as error:  # noqa: BLE001 - the device row reports it
        return f"unknown ({_one_line(error)})"


def _run(args, start: float) -> int:
    """Run the selected rows in order; print the table; return the exit status."""
    import torch

    budget = args.budget or (1800.0 if args.dry_cpu else 450.0)
    deadline = start + budget
    ctx = make_ctx(args)
    selected = [row for row in ROWS if (not args.only or row[0] in args.only) and row[0] not in args.skip]
    report = {"mode": "dry-cpu" if args.dry_cpu else ("cuda quick" if args.quick else "cuda"),
              "torch": torch.__version__, "device_name": _device_name(args),
              "complete": False, "seconds": 0.0, "rows": []}
    path = json_path(args)
    status = 0
    for index, (name, module, function, cap) in enumerate(selected):
        left = deadline - time.monotonic()
        row = {"name": name, "status": "skip", "seconds": 0.0, "numbers": {}, "reason": ""}
        if left < 5:  # a row that never ran is a failure of the check, not a pass
            row.update(status="FAIL", reason=f"not run: the {budget:.0f} s budget was spent")
            report["rows"].append(row)
            continue
        seconds = min(cap * (DRY_SLOWDOWN if args.dry_cpu else 1), left)
        ctx.deadline = time.monotonic() + seconds
        began = time.monotonic()
        broken = False
        try:
            fn = getattr(__import__(module), function)
            signal.setitimer(signal.ITIMER_REAL, seconds)
            try:
                row["numbers"] = fn(ctx)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            row["status"] = "ok"
        except Terminated as error:
            row.update(status="FAIL", reason=f"terminated ({error}) during this row")
            status = 124
        except RowTimeout:
            row.update(status="FAIL", reason=f"over its {seconds:.0f} s budget")
            broken = not _cuda_healthy(ctx)
        except Exception as error:  # noqa: BLE001 - one failing row must not stop the others
            from gpu_check_common import Skip

            row.update(status="skip" if isinstance(error, Skip) else "FAIL", reason=_one_line(error))
            broken = not _cuda_healthy(ctx)
        row["seconds"] = round(time.monotonic() - began, 1)
        report["rows"].append(row)
        report["seconds"] = time.monotonic() - start
        write_json(path, report)
        if not args.child:
            print(f"[gpu_check] {name}: {row['status']} {row['reason']}".rstrip(), flush=True)
        if status == 124:
            report["rows"].extend({"name": r[0], "status": "skip", "seconds": 0.0, "numbers": {},
                                   "reason": "not run: terminated"} for r in selected[index + 1:])
            break
        gc.collect()
        if ctx.device.type == "cuda" and not broken:
            torch.cuda.empty_cache()  # the next row starts from the memory the process group holds
        rest = [r[0] for r in selected[index + 1:]]
        if broken and rest and not args.child:
            report["rows"].extend(_run_in_child(args, rest, deadline - time.monotonic(), ctx))
            break
    report["complete"] = status != 124
    report["seconds"] = time.monotonic() - start
    write_json(path, report)
    if not args.child:
        print(format_table(report), flush=True)
    if status == 0 and any(r["status"] == "FAIL" for r in report["rows"]):
        status = 1
    import torch.distributed as dist

    if dist.is_initialized() and status != 124:
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
