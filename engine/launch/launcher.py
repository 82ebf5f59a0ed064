"""``python -m engine.launch [--section.key value ...]``: pre-flight, then torchrun, as a user expects.

``run_train.sh`` execs this module. It adds four things around torchrun (``torch.distributed.run``,
which still starts, watches and stops the ranks):

1. **Pre-flight.** The config is loaded and checked once, before any rank starts: first the config
   alone (no torch import), then every rule that the world size ``NGPU × NNODES`` decides
   (:func:`engine.setup.preflight.check_setup`). A problem prints one line and exits 2.
2. **One line per failure.** When ranks fail, each writes its one-line reason to a file in
   ``QUADRA_ERROR_DIR`` (see engine/train/main.py) instead of the terminal; this process prints each
   distinct reason once, with the ranks that gave it, and exits with their status (2 for set-up
   errors), without torchrun's traceback. ``QUADRA_TRACEBACK=1`` shows everything instead. A rank
   that crashed (a signal) is named with its last glibc / faulthandler lines, read back from its stderr,
   which torchrun writes to a file (``--redirects 2``) and the agent shows as it grows.
3. **Signals, however delivered.** SIGTERM and SIGUSR1 (scancel, ``--signal=USR1@120``, ``kill``,
   ``kill -- -<pgid>``, a container stop) to this process are forwarded to the ranks, which finish
   the current step, save a checkpoint together and exit 0 (engine/train/signals.py); torchrun is not
   allowed to turn them into a job failure. The first SIGINT (Ctrl-C) does the same; a second one
   kills the ranks at once (SIGKILL) and exits 130: the newest complete checkpoint stays, since a
   save only becomes visible when it is complete (engine/checkpoint/files.py).

4. **Restarts, hangs, shrinking.** torchrun runs with Quadra's agent (engine/launch/elastic.py):
   ``MAX_RESTARTS`` restarts a failed attempt unless a rank gave a reason a restart cannot cure, a
   hang is named from the ranks' records, and ``NNODES=MIN:MAX`` (c10d rendezvous) lets the group go
   on with the nodes that are left; the pre-flight then checks every node count of the range.

Environment: ``NGPU`` (processes on this node; default: visible GPUs, else 2), ``NNODES`` (default 1;
``MIN:MAX``: elastic, with ``RDZV_ID`` and ``RDZV_CONF``), ``MAX_RESTARTS`` (default 0),
``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (rendezvous when ``NNODES > 1``: torchrun's static
rendezvous, so node ``NODE_RANK`` holds ranks ``NODE_RANK × NGPU ...``), ``LOG_RANKS`` (local ranks whose
output is shown), ``OMP_NUM_THREADS`` (default: cores / NGPU). They are read and checked, and torchrun's
command line made from them, in engine/launch/environment.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import time

from engine.launch.environment import (LaunchError, env_int, gpus_visible, node_range,  # torch-free
                                       nproc_per_node, torchrun_args)
from engine.launch.failures import PEER_FAILURE, crash_report, crash_summary, how_it_ended  # torch-free
from engine.launch.replica_groups import (ReplicaLaunchError, check_lighthouse, group_arguments,  # torch-free
                                          launch_replica_groups, lighthouse_address)

ABORT_EXIT = 130  # 128 + SIGINT, the shell's convention for a run interrupted by Ctrl-C


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # (flush: stderr is line-buffered since Python 3.9: equivalent)


class _Signals:
    """SIGTERM/SIGUSR1/SIGINT handling of the launcher process (see the module docstring)."""

    def __init__(self):
        self.interrupts = 0
        self.received: str | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:  # say at once what happens: a long step may take a while to end
            again = "; Ctrl-C again stops at once without saving" if signum == signal.SIGINT else ""
            _say(f"quadra: received {name}: the ranks finish the current step, save a checkpoint (when "
                 f"checkpoint.enable) and exit{again}")
        self.received = self.received or name
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts >= 2:  # a second Ctrl-C: stop now; the last complete save remains
                _kill_children(signal.SIGKILL)
                return
        _kill_children(signum)


def _kill_children(signum: int) -> None:
    """Send ``signum`` to this process's children (torchrun's agent runs in this process, so they
    are the ranks). Children are read from /proc; elsewhere the signal is not forwarded."""
    me = str(os.getpid())
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]  # (comm may hold ')': the last one ends it)
        except (OSError, IndexError):
            continue
        if ppid == me:
            try:
                os.kill(int(pid), signum)
            except OSError:
                pass


def _summarize_failure(error, error_dir: str, signals: _Signals, stderr_files: dict[int, str] | None = None) -> int:
    """One line per root cause of a failed run; returns the exit status.

    Root causes, in this order: the ranks' own one-line reasons (error files), except the
    "another rank went away" of ranks that only lost a peer; else the ranks that died without a
    reason (a signal other than the SIGTERM torchrun sends the survivors, or a crash); else that
    collateral. Identical reasons from several ranks print once. A rank ended by a signal whose stderr
    file (``stderr_files``: {global rank: path}) holds a crash report (glibc's heap-check message,
    faulthandler's stacks: engine/launch/failures.py) is named with it; the report's lines are printed
    before that line when ``LOG_RANKS`` hid the rank.
    """
    if signals.interrupts >= 2:
        _say("quadra: stopped at once by a second Ctrl-C (SIGINT); the same command resumes from the newest "
             "complete checkpoint")
        return ABORT_EXIT
    messages: dict[int, str] = {}
    for name in sorted(os.listdir(error_dir)):
        if name.startswith("rank") and name.endswith(".err"):
            with open(os.path.join(error_dir, name)) as f:
                text = f.read().strip()
            if text:
                messages[int(name[4:-4])] = text
    failures = getattr(error, "failures", {})
    codes = {rank: failure.exitcode for rank, failure in failures.items()}
    own = {rank: text for rank, text in messages.items() if not text.startswith(PEER_FAILURE)}
    if own:
        grouped: dict[str, list[int]] = {}
        for rank, text in sorted(own.items()):
            grouped.setdefault(text, []).append(rank)
        for text, ranks in grouped.items():
            _say(text if len(grouped) == 1 else f"[rank{','.join(map(str, ranks))}] {text}")
        # A rank that gave its reason may still be ended by torchrun's SIGTERM (a negative code).
        statuses = [code if (code := codes.get(rank, 1)) > 0 else 1 for rank in own]  # (> 1: 1 -> 1)
        return 2 if 2 in statuses else max(statuses)
    died = {rank: code for rank, code in codes.items()
            if rank not in messages and code != -int(signal.SIGTERM)}
    for rank, code in sorted((died or {r: c for r, c in codes.items() if r not in messages}).items()):
        report = crash_report((stderr_files or {}).get(rank)) if code < 0 else []
        if not report:
            _say(f"quadra: rank {rank} ended with {how_it_ended(code)} (killed, out of memory, or a crash shown "
                 "above); the other ranks were stopped. Rerun with QUADRA_TRACEBACK=1 for every rank's traceback")
            continue
        if not _rank_shown(getattr(failures.get(rank), "local_rank", None)):  # (torchrun's failures have local_rank)
            for line in report:
                _say(f"[rank{rank}] {line}")
        stacks = " (its stacks are above)" if any(line.startswith("Current thread") for line in report) else ""
        _say(f"quadra: rank {rank} ended with {how_it_ended(code)}: {crash_summary(report)}{stacks}; the other ranks "
             "were stopped")
    if not died and messages:
        _say(next(iter(messages.values())))
    return 1


def _rank_shown(local_rank: int | None) -> bool:
    """Whether this local rank's output reached the terminal (``LOG_RANKS``, e.g. ``0,2``; unset: all)."""
    ranks = os.environ.get("LOG_RANKS", "")  # (None or '': all shown)
    return not ranks or local_rank is None or str(local_rank) in [r.strip() for r in ranks.split(",")]


def main(argv: list[str] | None = None) -> int:
    """Pre-flight, launch and wait; returns the exit status (see the module docstring)."""
    launch_time = time.time()
    argv = sys.argv[1:] if argv is None else argv
    argv = [token for arg in argv for token in (["--job.dry_run", "true"] if arg == "--dry_run" else [arg])]
    from engine.config import ConfigError, load_config

    try:
        cfg = load_config(argv)
        cfg.validate()
        nodes = node_range()
        max_restarts = env_int("MAX_RESTARTS", 0)
        gpus = gpus_visible()
        nproc = nproc_per_node(gpus)
        if cfg.job.dry_run:  # one process, no rendezvous: NNODES needs no MASTER_ADDR here
            from engine.launch.dry_run import dry_run

            return dry_run(cfg, nproc * nodes[1], gpus_per_node=nproc)
        if not os.environ.get("OMP_NUM_THREADS"):  # processes share the cores: one share each
            os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
        entry = ["-m", "engine.train", *argv]
        torchrun_argv = torchrun_args(nproc, nodes, entry, max_restarts)
        groups_here = _replica_groups(cfg, nproc, nodes[1])  # torchft: ranks per group of this node, or 0
    except ConfigError as error:
        _say(f"config error: {error}")
        return 2
    except (LaunchError, ReplicaLaunchError) as error:
        _say(f"launch error: {error}")
        return 2
    status = _preflight(cfg, groups_here or nproc, nodes, gpus)
    if status:
        return status
    if groups_here:
        try:
            return launch_replica_groups(cfg, argv, nproc, nodes[1])
        except ReplicaLaunchError as error:
            _say(f"launch error: {error}")
            return 2
    return _launch(cfg, torchrun_argv, max_restarts, launch_time)


def _replica_groups(cfg, nproc: int, nnodes: int) -> int:
    """``[fault_tolerance]`` (engine/launch/replica_groups.py): ranks per group when this launch starts
    every group of the node (``replica_id = -1``); 0 for a plain launch or one group (whose lighthouse
    must answer).

    Raises:
        ReplicaLaunchError: several nodes with ``replica_id = -1``, NGPU not divisible by the groups, or
            one group's launch without a lighthouse that answers.
    """
    ft = cfg.fault_tolerance
    if not ft.enable:
        return 0
    if ft.replica_id == -1:
        return group_arguments(ft, nproc, nnodes)
    address = lighthouse_address(ft)
    if os.environ.get("QUADRA_PREFLIGHT_DONE"):  # a group of replica_groups.py, whose lighthouse is starting
        return 0
    if not address:
        raise ReplicaLaunchError(f"fault_tolerance.replica_id = {ft.replica_id} needs the job's lighthouse: set "
                                 "fault_tolerance.lighthouse or TORCHFT_LIGHTHOUSE to http://HOST:PORT")
    check_lighthouse(address)
    return 0


def _preflight(cfg, nproc: int, nodes: tuple[int, int], gpus: int) -> int:
    """The checks the world size decides (every world size ``NNODES=MIN:MAX`` allows); -> 0 or 2."""
    from engine.setup.preflight import check_setup, hardware_warnings

    low, nnodes = nodes
    world_size = nproc * nnodes
    device_type = cfg.job.device if cfg.job.device != "auto" else ("cuda" if gpus else "cpu")
    try:
        setup = check_setup(cfg, world_size, device_type)
        if low < nnodes:
            _check_shrinkable(cfg, nproc, nodes, device_type, check_setup)
    except (ValueError, FileNotFoundError) as error:
        _say(f"set-up error: {error}")
        return 2
    # (A replica group's launch started by engine/launch/replica_groups.py: its parent said them.)
    warnings = [] if os.environ.get("QUADRA_PREFLIGHT_DONE") else [
        *cfg.warnings(), *setup.warnings, *hardware_warnings(cfg, device_type)]
    for warning in warnings:
        _say(f"warning: {warning}")
    if gpus:  # the planner's fit check; only where CUDA GPUs are (the CPU path imports no torch here)
        from engine.launch.dry_run import fit_warning

        warning = fit_warning(cfg, world_size, gpus_per_node=nproc, setup=setup)
        if warning:
            _say(f"warning: {warning}")
    return 0


def _check_shrinkable(cfg, nproc: int, nodes: tuple[int, int], device_type: str, check_setup) -> None:
    """``NNODES=MIN:MAX``: a degree must absorb a change of world size (``dp_shard = -1``), and every
    node count in the range must give a valid layout.

    Raises:
        ValueError: every degree fixed, or a node count whose world size the layout rules refuse.
    """
    low, high = nodes
    if cfg.parallelism.dp_shard != -1:
        raise ValueError(
            f"NNODES={low}:{high} lets the group shrink to {low} node{'s' * (low > 1)}, but every degree is fixed "
            f"(parallelism.dp_shard = {cfg.parallelism.dp_shard}): set parallelism.dp_shard = -1 so that it "
            f"absorbs the nodes that are gone, or NNODES={high}")
    for count in range(low, high):
        try:
            check_setup(cfg, nproc * count, device_type, check_data=False)
        except ValueError as error:
            raise ValueError(f"NNODES={low}:{high}: on {count} node{'s' * (count > 1)} (world_size "
                             f"{nproc * count}) {error}") from None


def _launch(cfg, torchrun_argv: list[str], max_restarts: int, launch_time: float) -> int:
    """torchrun with Quadra's agent (engine/launch/elastic.py); -> the exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from engine.launch.elastic import Recovery, run_elastic
    from engine.observe.goodput import append_failed_launch
    from engine.observe.hang import FR_BUFFER

    traceback = bool(os.environ.get("QUADRA_TRACEBACK"))
    if not traceback:  # torchrun logs each failed rank at ERROR level; we print the reason instead
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    error_dir = tempfile.mkdtemp(prefix="quadra-errors-")
    os.environ.update(QUADRA_ERROR_DIR=error_dir, QUADRA_LAUNCH_TIME=repr(launch_time),
                      QUADRA_MAX_RESTARTS=str(max_restarts))
    os.environ["QUADRA_LAUNCHER"] = "1"  # ranks: warnings were printed here; Ctrl-C is counted here
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FR_BUFFER)  # Flight Recorder: the hang report reads it
    signals = _Signals()
    recovery = Recovery(error_dir, cfg.run_folder, max_restarts, cfg.comm.hang_timeout_seconds,
                        stop_requested=lambda: signals.received is not None)
    # Each rank's stderr goes to a file (and on to the terminal through the agent, engine/launch/elastic.py)
    # so that a crashed rank's glibc / faulthandler lines can be named in the verdict.
    torchrun_argv = [f"--log-dir={os.path.join(error_dir, 'ranks')}", "--redirects=2", *torchrun_argv]
    try:
        run_elastic(torchrun_argv, recovery)
        return 0
    except ChildFailedError as error:
        if traceback:
            raise
        if recovery.hang and signals.interrupts < 2:
            _say(recovery.hang)
            status = 1
        else:
            status = _summarize_failure(error, error_dir, signals, recovery.stderr_files)
        append_failed_launch(error_dir, cfg.run_folder, launch_time)  # the goodput ledger of the launch
        return status
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)  # (the folder is ours)
