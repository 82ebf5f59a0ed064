"""Entry point: ``python -m engine.train --job.config_file X.toml [--section.key value ...]``.

``run_train.sh`` launches this under torchrun (through engine/launch/launcher.py). Configuration and set-up
errors (bad settings, mismatched sizes, missing files) exit with status 2 before any heavy work; a
diverged loss exits with status 1; a second Ctrl-C outside the launcher exits 130. The reason is one
line: written to ``$QUADRA_ERROR_DIR/rank<N>.err`` when the launcher set that (it prints each distinct
reason once), else printed with a ``[rankN]`` prefix. Set ``QUADRA_TRACEBACK=1`` to see full
tracebacks. A crash (SIGSEGV, SIGABRT from glibc's heap checks, SIGBUS, SIGFPE, SIGILL) prints every
thread's Python stack to stderr (faulthandler), which the launcher names in its verdict. SIGTERM,
SIGUSR1 or a first SIGINT stops every rank after the current step (engine/train/signals.py); with
checkpointing on, the state is saved first, and the process exits 0 with one line saying so.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys

logger = logging.getLogger("quadra")


def _fail(rank: int, kind: str, error: BaseException | str, code: int) -> int:
    if os.environ.get("QUADRA_TRACEBACK"):
        logger.exception("%s", kind)
    error_dir = os.environ.get("QUADRA_ERROR_DIR")
    if error_dir and os.path.isdir(error_dir):  # the launcher prints it once for all ranks that agree
        path = os.path.join(error_dir, f"rank{rank}.err")
        with open(path + ".tmp", "w") as f:
            f.write(f"{kind}: {error}\n")
        os.replace(path + ".tmp", path)  # whole or absent when the launcher reads it
        return code
    # Every line carries the rank prefix, so multi-line messages stay readable when ranks interleave.
    lines = f"{kind}: {error}".splitlines()
    # One write call: ranks share the terminal, and a write under 4 KiB to a pipe is not interleaved.
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), "".join(f"[rank{rank}] {line}\n" for line in lines).encode())
    return code


def main(argv: list[str] | None = None) -> int:
    """Parse the config, build the trainer, train; returns the process exit status."""
    from engine.config import ConfigError, load_config

    # Every thread's stack on a fatal signal; the signal still ends the process (exit code -SIG).
    faulthandler.enable(file=sys.stderr, all_threads=True)
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(argv)
        cfg.validate()
    except ConfigError as error:
        return _fail(rank, "config error", error, 2)
    if cfg.job.dry_run:  # one process for the whole world (engine/launch/dry_run.py), not one per rank
        return _fail(rank, "config error", "job.dry_run = true is done by the launcher in one process: run "
                     "./run_train.sh --dry_run (or python -m engine.launch ... --dry_run), not torchrun", 2)

    from engine.train import signals

    signals.install()  # before set-up, so that a stop signal during it is not lost
    from engine.train.distributed import die_with_parent, is_peer_failure, shutdown_distributed
    from engine.observe.console import init_logging
    from engine.train.trainer import Trainer, TrainingDivergedError

    if os.environ.get("QUADRA_LAUNCHER"):
        die_with_parent()
    init_logging(rank, quiet=rank != 0 and not cfg.metrics.log_all_ranks)
    if rank == 0 and not os.environ.get("QUADRA_LAUNCHER"):  # the launcher printed them already
        for warning in cfg.warnings():
            logger.warning("%s", warning)
    clean = False
    try:
        status = _build_and_train(cfg, rank, Trainer, TrainingDivergedError)
        clean = status == 0
        return status
    except KeyboardInterrupt:
        return _fail(rank, "interrupted", "second SIGINT: stopped without saving; the same command "
                     "resumes from the newest complete checkpoint", 130)
    except Exception as error:
        if not is_peer_failure(error) or os.environ.get("QUADRA_TRACEBACK"):
            raise
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return _fail(rank, "stopped", f"another rank went away during a collective ({first_line[:200]})", 1)
        # (engine/launch/launcher.py recognizes this "stopped: another rank went away" as collateral)
    finally:
        shutdown_distributed(clean=clean)


def _build_and_train(cfg, rank: int, trainer_cls, diverged_error) -> int:
    from engine.train.trainer import AfterStepError

    try:
        trainer = trainer_cls(cfg)
    except (ValueError, FileNotFoundError) as error:
        return _fail(rank, "set-up error", error, 2)
    ranks_alive = False  # until train() returns or every rank raised the same divergence
    try:
        trainer.train()
        ranks_alive = True
        # The goodput ledger of the launch (engine/train/recovery.py), rank 0.
        goodput = trainer.recovery.finish(trainer.metrics, f"stopped by {trainer.stopped_by}" if trainer.stopped_by
                                          else "completed")
    except diverged_error as error:
        ranks_alive = True
        return _fail(rank, "training stopped", error, 1)
    except AfterStepError as error:  # the step was saved first; its message names what is safe
        return _fail(rank, "training stopped", error, 1)
    finally:
        # After any other failure, close what can be closed without waiting on other ranks.
        trainer.close(wait=ranks_alive)
    if trainer.stopped_by:
        if trainer.stop_saved:
            done = f"saved checkpoint step-{trainer.step}"
        elif trainer.step == 0:
            done = "stopped before the first step"
        elif cfg.checkpoint.enable:
            done = f"nothing trained since checkpoint step-{trainer.step}"
        else:
            done = f"stopped after step {trainer.step} without a checkpoint (checkpoint.enable = false)"
        if rank == 0:
            logger.info("received %s: %s, exiting", trainer.stopped_by, done)
        return 0
    if rank == 0:
        logger.info("training finished after %d steps (%s)%s; run folder: %s", trainer.step,
                    trainer.step_health.summary(), f"; {goodput}" if goodput else "", trainer.run_folder)
    return 0
