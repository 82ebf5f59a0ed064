"""Launching torchft replica groups: the lighthouse, and one torchrun per group on this node.

With ``[fault_tolerance] enable`` every launch of ``engine.launch`` is one replica group
(engine/train/fault_tolerance.py). ``replica_id = -1`` (the default) is the single-node form: this
module starts a lighthouse (torchft's ``torchft_lighthouse``, which forms each step's quorum) unless
one is named, then ``group_size`` launches of ``engine.launch``, each with ``NGPU / group_size``
ranks and its own ``--fault_tolerance.replica_id``. Each group is its own torchrun: ``MAX_RESTARTS``
restarts a failed group alone while the others step on, and the restarted group heals from a live
one. Several nodes start one group per launch by hand (see engine/docs/fault-tolerance.md,
"Fault-tolerant replica groups").
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


class ReplicaLaunchError(Exception):
    """A fault-tolerance launch setting that cannot work; printed as one line, exit 2."""


def lighthouse_address(section) -> str:
    """``fault_tolerance.lighthouse``, else ``$TORCHFT_LIGHTHOUSE``, else "" (none given)."""
    return section.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")


def check_lighthouse(address: str, timeout_s: float = 5.0) -> None:
    """Refuse a lighthouse that does not answer (a TCP connection to its host and port).

    Raises:
        ReplicaLaunchError: a malformed address, or nothing listening there within ``timeout_s`` seconds.
    """
    parsed = urlparse(address if "://" in address else f"http://{address}")
    if not parsed.hostname or not parsed.port:
        raise ReplicaLaunchError(f"fault_tolerance.lighthouse = {address!r} must be http://HOST:PORT (or set "
                                 f"{LIGHTHOUSE_ENV})")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((parsed.hostname, parsed.port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise ReplicaLaunchError(
                    f"fault_tolerance.lighthouse = {address!r}: no lighthouse answers there; start one "
                    f"(torchft_lighthouse --min_replicas 1 --bind [::]:{parsed.port}) or, on one node, leave "
                    f"the address and {LIGHTHOUSE_ENV} empty so that ./run_train.sh starts it") from None
            time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def start_lighthouse(min_replicas: int, log_path: str, join_timeout_ms: int = 1000) -> tuple[subprocess.Popen, str]:
    """Start ``torchft_lighthouse`` on a free port of this host, its output in ``log_path``; -> (process,
    its http address). It answers once it has imported torchft (seconds); the groups' managers wait
    for it (their connect timeout is ``quorum_timeout_seconds``), so the groups start at once.

    A quorum waits up to ``join_timeout_ms`` for the groups whose managers heartbeat but have not asked
    yet, so a dead group (heartbeats stop; left out after 5 s) holds the others about a second; a
    restarted group joins the quorum after the one it asks for. A job's first step waits for every
    group (engine/train/fault_tolerance.py).

    Raises:
        ReplicaLaunchError: the binary (installed with torchft) is not found.
    """
    binary = shutil.which("torchft_lighthouse") or os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    if not os.path.exists(binary):
        raise ReplicaLaunchError('fault_tolerance.enable = true: torchft_lighthouse is not found; install torchft '
                                 'with pip install -e ".[ft]"')
    port = _free_port()
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [binary, "--min_replicas", str(min_replicas), "--bind", f"[::]:{port}", "--quorum_tick_ms", "100",
             "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms", "5000"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return process, f"http://{socket.gethostname()}:{port}"


def group_arguments(section, nproc: int, nnodes: int) -> int:
    """Ranks per group on this node for ``replica_id = -1``.

    Raises:
        ReplicaLaunchError: several nodes (start one group per launch there), or NGPU not divisible by
            ``group_size``.
    """
    if nnodes > 1:
        raise ReplicaLaunchError(f"fault_tolerance.replica_id = -1 starts every group on this node; with NNODES="
                                 f"{nnodes} start one group per launch: --fault_tolerance.replica_id N and "
                                 f"{LIGHTHOUSE_ENV}=http://HOST:PORT on every node of group N")
    if nproc % section.group_size:
        raise ReplicaLaunchError(f"fault_tolerance.group_size = {section.group_size} must divide NGPU = {nproc} "
                                 "(each group gets NGPU / group_size ranks); set NGPU to a multiple of it")
    return nproc // section.group_size


def run_groups(section, argv: list[str], per_group: int, address: str, lighthouse=None) -> int:
    """Start ``group_size`` launches of ``engine.launch`` and wait for all; -> the worst exit status.

    SIGTERM / SIGUSR1 / SIGINT to this process go to every group's launcher (each saves and exits 0
    as a single launch does)."""
    # RUST_LOG: torchft's Rust side logs every quorum and commit at INFO; warnings and errors stay.
    env = {"RUST_LOG": "warn", **os.environ, "NGPU": str(per_group), LIGHTHOUSE_ENV: address,
           "QUADRA_PREFLIGHT_DONE": "1"}  # (also: the lighthouse is ours, its groups need not check it)
    groups = [subprocess.Popen([sys.executable, "-m", "engine.launch", *argv,
                                "--fault_tolerance.replica_id", str(g)], env={**env, "QUADRA_REPLICA_ID": str(g)})
              for g in range(section.group_size)]

    def forward(signum, frame):
        for group in groups:
            if group.poll() is None:
                group.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, forward)
    while any(group.poll() is None for group in groups):
        if lighthouse is not None and lighthouse.poll() is not None:
            print(f"quadra: the torchft lighthouse ended with status {lighthouse.returncode} (its output: "
                  "lighthouse.log in the run folder); the groups fail at their next quorum", file=sys.stderr)
            lighthouse = None
        time.sleep(0.5)
    statuses = [group.returncode for group in groups]
    return max(statuses, key=lambda status: (status != 0, abs(status)))


def launch_replica_groups(cfg, argv: list[str], nproc: int, nnodes: int) -> int:
    """``replica_id = -1``: a lighthouse (unless one is named) and every group of this node; -> exit status."""
    section = cfg.fault_tolerance
    per_group = group_arguments(section, nproc, nnodes)
    address, lighthouse = lighthouse_address(section), None
    if address:
        check_lighthouse(address)
    else:
        lighthouse, address = start_lighthouse(section.min_replica_size, os.path.join(cfg.run_folder, "lighthouse.log"))
        print(f"quadra: torchft lighthouse at {address} (min_replicas {section.min_replica_size}); "
              f"{section.group_size} replica groups of {per_group} ranks", file=sys.stderr, flush=True)
        # (flush: sys.stderr is line-buffered since Python 3.9, so a mutant without it is equivalent)
    try:
        return run_groups(section, argv, per_group, address, lighthouse)
    finally:
        if lighthouse is not None:
            lighthouse.terminate()
            lighthouse.wait()
