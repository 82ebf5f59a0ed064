#!/usr/bin/env python
"""Is my layout the same run? Train a config under one process and under parallel layouts for a few
steps on the same data, and compare loss, grad norm and final parameters.

    ./scripts/parity.py                                   # train_configs/debug_model.toml, --layouts auto
    ./scripts/parity.py --config my.toml --layouts "fsdp2,tp2,pp2:1F1B,cp2,tp2xpp2" --steps 5
    ./scripts/parity.py --layouts fsdp2xtp2 --json parity.json --training.seq_len 64
    ./scripts/parity.py --config my.toml --precision fp64 --locate
    ./scripts/parity.py --replay outputs/my_run --step 1234 --layouts "tp2,fsdp4"

Each run is the engine's own launcher (what ./run_train.sh runs) with the layout's degrees; its
metrics.jsonl gives loss and grad norm per step, its final checkpoint the parameters. Layout names
(engine/parity/layouts.py): ddpN, fsdpN, hsdpN, tpN[:nosp], ppN[:schedule], cpN[:allgather], epN,
accumN, joined by 'x' (fsdp2xtp2xpp2). Exit status: 0 when every layout passes, 1 when one fails,
2 for bad input (one line).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from scripts.project_env import use_project_python  # noqa: E402

use_project_python()  # the system Python of a fresh machine lacks torch: re-run under .venv's

DEFAULT_CONFIG = "train_configs/debug_model.toml"
CPU_PROCESS_BUDGET = 8


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse's own status)
        self.exit(2, f"parity error: {message}; see --help\n")


def _args(argv):
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="Any other --section.key value is a config override applied to every run.")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="TOML config (default: %(default)s)")
    p.add_argument("--layouts", default="auto", help="comma-separated layout names, or 'auto': every "
                   "legal layout of engine/parity/layouts.py that fits --procs (default)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per run (default %(default)s)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "fp64"), help="fp32: the config's "
                   "dtypes, relative tolerance 1e-5 at step 1, 1e-4 after; fp64: every run in the float64 "
                   "reference mode (training.mixed_precision_param/_reduce and optimizer.muon_ns_dtype = float64), "
                   "tolerance 1e-12")
    p.add_argument("--noise_floor", default="auto", choices=("auto", "on", "off"), help="judge layouts against "
                   "the reference's measured noise floor (engine/parity/noise.py: the reference retrained with its "
                   "sequences reordered and, on the CPU, on other kernels; a layout passes within 10x of it); "
                   "auto: when the config is not exact to float32 (float8, bfloat16, Muon's bfloat16 Newton-Schulz)")
    p.add_argument("--procs", type=int, default=0, help="process budget of --layouts auto (default: the "
                   f"visible GPUs, else {CPU_PROCESS_BUDGET})")
    p.add_argument("--keep_max_norm", action="store_true", help="when training.max_norm clips no step, only "
                   "say so (default: run everything again with a max_norm that clips)")
    p.add_argument("--replay", default="", help="a run folder: resume every run from its newest checkpoint at "
                   "or before --step (with optimizer, schedule and data position), train to --step, compare; "
                   "its config.toml is the config and the max_norm is kept")
    p.add_argument("--step", type=int, default=0, help="with --replay: the step to reach")
    p.add_argument("--locate", action="store_true", help="for each failing layout, find the first module "
                   "whose output differs from one process's at the first failing step, and the first gradient "
                   "(engine/parity/locate.py); every run records its first step, the reference keeps every step")
    p.add_argument("--json", default="", help="write the full report (every step of every run) here")
    p.add_argument("--out", default="", help="folder for the run folders (default: a temporary one, deleted)")
    return p.parse_known_args(argv)


def _refuse(message: str) -> int:
    print(f"parity error: {message}", file=sys.stderr)
    return 2


def _config_argv(a, extra: list[str]) -> list[str] | str:
    """The config arguments of every run, or the one-line reason they cannot work."""
    if not os.path.isfile(a.config):
        return f"--config {a.config}: no such file; pass a TOML config, e.g. {DEFAULT_CONFIG}"
    if any(not token.startswith("--") for token in extra[::2]) or len(extra) % 2:
        return f"unrecognized arguments {' '.join(extra)}; config overrides are --section.key value pairs"
    return ["--job.config_file", os.path.abspath(a.config), *extra]


def _replay_argv(a, extra: list[str]) -> tuple[list[str], int] | str:
    """(config arguments resuming ``a.replay``'s newest checkpoint at or before ``a.step``, its step),
    or the one-line reason that cannot work."""
    from engine.checkpoint import files
    from engine.config import ConfigError, load_config

    config = os.path.join(a.replay, "config.toml")
    if not os.path.isfile(config):
        return f"--replay {a.replay}: no config.toml there; pass a run folder (job.dump_folder of a run)"
    if a.step < 1:
        return f"--step {a.step}: --replay needs the step to reach, e.g. --step 100"
    try:
        cfg = load_config(["--job.config_file", config])
    except ConfigError as error:
        return f"--replay {a.replay}: its config.toml does not load ({error})"
    folder = cfg.checkpoint.folder if os.path.isabs(cfg.checkpoint.folder) else \
        os.path.join(a.replay, cfg.checkpoint.folder)
    steps = sorted(s for s in files.scan(folder).complete if s <= a.step)
    if not steps:
        return f"--replay {a.replay}: no complete checkpoint at or before step {a.step} in {folder}"
    if steps[-1] == a.step:
        steps = steps[:-1] or steps  # a checkpoint at the step itself leaves nothing to train
    if steps[-1] >= a.step:
        return f"--replay {a.replay} --step {a.step}: the only checkpoint is step-{steps[-1]}; choose a later --step"
    # training.steps stays the run's (its LR schedule); each run stops after --step instead.
    argv = ["--job.config_file", config, *extra, "--checkpoint.initial_load_path", files.step_dir(folder, steps[-1]),
            "--checkpoint.initial_load_model_only", "false", "--training.stop_after_step", str(a.step)]
    return argv, steps[-1]


def _select_layouts(a, argv: list[str], cfg, device_type: str):
    """(layouts to run, lines about the auto layouts left out) or raise ValueError with one line."""
    from engine.parity.layouts import auto_layouts, check_layout, fit_batch, parse_layout

    from engine.setup.preflight import resolve_model_setup

    moe = getattr(resolve_model_setup(cfg).args, "num_experts", 0) > 0
    if a.layouts.strip() == "auto":
        layouts, left_out = auto_layouts(a.procs, moe)
    else:
        layouts, left_out = [parse_layout(n) for n in a.layouts.split(",") if n.strip()], []
        if not layouts:
            raise ValueError(f"--layouts {a.layouts!r} names no layout; e.g. --layouts fsdp2,tp2")
    kept = []
    for layout in layouts:
        try:
            layout = fit_batch(layout, cfg.training.local_batch_size, cfg.training.global_batch_size)
            reason = check_layout(argv, layout, device_type)
        except ValueError as error:
            reason = str(error)
        if reason is None:
            kept.append(layout)
        elif a.layouts.strip() == "auto":
            left_out.append(f"{layout.name}: {reason}")
        else:
            raise ValueError(f"layout {layout.name}: {reason}")
    return kept, left_out


def main(argv: list[str] | None = None) -> int:
    a, extra = _args(sys.argv[1:] if argv is None else argv)
    # SIGTERM (timeout, scancel) unwinds like Ctrl-C: the running launch is stopped, the folder removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if a.steps < 1:
        return _refuse(f"--steps {a.steps} must be >= 1")
    start_step = 0
    if a.replay:
        replay = _replay_argv(a, extra)
        if isinstance(replay, str):
            return _refuse(replay)
        (base, start_step), a.steps, a.keep_max_norm = replay, a.step, True
    else:
        base = _config_argv(a, extra)
    if isinstance(base, str):
        return _refuse(base)
    if a.locate:  # checked with the config: a compiled run cannot be recorded (engine/config/validation.py)
        base += ["--record.step", str(start_step + 1)]
    if a.precision == "fp64":
        # Muon's Newton-Schulz too (bfloat16 by default): else one rounding flip in bfloat16 is 4e-3.
        base += ["--training.mixed_precision_param", "float64", "--training.mixed_precision_reduce", "float64",
                 "--optimizer.muon_ns_dtype", "float64"]
    import torch

    from engine.config import ConfigError, load_config
    from engine.parity.locate import format_findings
    from engine.parity.sweep import PRECISIONS, Sweep, format_table, original_row, progress_line

    try:
        cfg = load_config(base)
        cfg.validate()
    except (ConfigError, ValueError) as error:
        return _refuse(str(error))
    if cfg.training.global_batch_size <= 0:  # -1 grows with dp: fix it at one process's batch
        base += ["--training.global_batch_size", str(cfg.training.local_batch_size)]
        cfg = load_config(base)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and cfg.job.device != "cpu" else 0
    device_type = "cuda" if gpus else "cpu"
    a.procs = a.procs or gpus or CPU_PROCESS_BUDGET
    try:
        layouts, left_out = _select_layouts(a, base, cfg, device_type)
    except ValueError as error:
        return _refuse(str(error))
    if not layouts:
        return _refuse(f"no layout of --layouts {a.layouts} fits --procs {a.procs}: " + "; ".join(left_out[:3]))
    precision = PRECISIONS[a.precision]
    from engine.parity.noise import MARGIN, inexact_settings

    if a.noise_floor == "on" and a.precision == "fp64":
        return _refuse("--noise_floor on --precision fp64: the float64 reference mode is judged at 1e-12; the noise "
                       "floor is for float32 configs that are not exact (float8, bfloat16, Muon's bfloat16 "
                       "Newton-Schulz): drop one of the two")
    inexact = inexact_settings(cfg) if a.precision == "fp32" else []
    noise_floor = a.noise_floor == "on" or (a.noise_floor == "auto" and bool(inexact))
    folder = a.out or tempfile.mkdtemp(prefix="quadra-parity-")
    print(f"parity of {a.config} ({cfg.model.name}/{cfg.model.flavor}), {a.steps} steps, {a.precision}, "
          f"{len(layouts)} layouts on {device_type} vs one process; run folders in {folder}", flush=True)
    for line in left_out:
        print(f"  left out {line}")
    if a.replay:
        print(f"replaying {a.replay} from its checkpoint step-{start_step} to step {a.steps} "
              f"({a.steps - start_step} steps per run)")
    start = time.perf_counter()
    sweep = Sweep(base, a.steps, precision, folder, engage_clipping=not a.keep_max_norm,
                  say=lambda line: print(line, flush=True), replay=bool(a.replay),
                  locate_from=(start_step + 1) if a.locate else 0, noise_floor=noise_floor,
                  device_type=device_type, local_batch_size=cfg.training.local_batch_size,
                  pp_microbatch_size=cfg.parallelism.pp_microbatch_size,
                  match_microbatches=noise_floor and cfg.float8.enable)
    try:
        clipping = sweep.run_reference(cfg.training.max_norm)
        print(f"reference (1 process): {sweep.reference.seconds:.0f} s; clipping "
              f"{'engaged' if clipping['engaged'] else 'NOT engaged'} at max_norm {clipping['max_norm']:g} "
              f"({clipping['clipped_steps']} steps clipped, {clipping['unclipped_steps']} not)", flush=True)
        if sweep.floor:
            twins = ", ".join(f"{name} {value:.2e}" for name, value in sweep.twin_floors.items())
            print(f"noise floor ({'; '.join(inexact) or 'asked for'}): the reference against its twins: {twins}; "
                  f"final parameters {sweep.parameter_floor:.2e}; a layout passes within {MARGIN:g}x the floor "
                  f"of each step", flush=True)
        rows = []
        if a.replay:
            rows.append(original_row(a.replay, sweep, start_step))
            print(f"  {progress_line(rows[0])}", flush=True)
        for layout in layouts:
            row = sweep.compare(layout)
            rows.append(row)
            print(f"  {progress_line(row)}", flush=True)
            if row["error"]:
                print("    " + row["error"].replace("\n", "\n    "))
            if "locate" in row:
                print(format_findings(row["layout"], row["locate"], row["locate"].get("start", "")), flush=True)
    except RuntimeError as error:
        print(f"parity error: {error}", file=sys.stderr)
        return 1
    finally:
        if not a.out:
            shutil.rmtree(folder, ignore_errors=True)
    print(format_table(rows, precision, sweep))
    passed = all(row["passed"] for row in rows)
    print(f"{sum(r['passed'] for r in rows)}/{len(rows)} layouts pass; {time.perf_counter() - start:.0f} s in all")
    if a.json:
        report = {"config": a.config, "overrides": extra, "precision": precision, "steps": a.steps,
                  "device": device_type, "process_budget": a.procs, "clipping": clipping,
                  "reference": {"history": sweep.reference.history, "seconds": round(sweep.reference.seconds, 1)},
                  "layouts": rows, "left_out": left_out, "passed": passed,
                  "noise_floor": {"steps": sweep.floor, "parameters": sweep.parameter_floor, "margin": MARGIN,
                                  "twins": sweep.twins, "settings": inexact} if sweep.floor else None,
                  "seconds": round(time.perf_counter() - start, 1)}
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.json}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
