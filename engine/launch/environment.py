"""The launch environment, read once by the launcher before any rank starts (torch-free): the
variables a user sets, checked, and torchrun's command line for this node from them.

``NGPU`` (processes on this node; default: visible GPUs, else 2), ``NNODES`` (``N``, or ``MIN:MAX``:
elastic, with ``RDZV_ID`` and ``RDZV_CONF``), ``MAX_RESTARTS``, ``NODE_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, ``LOG_RANKS``: what each means is in engine/launch/launcher.py's docstring. A value that
cannot work raises :class:`LaunchError`, which the launcher prints as one line (exit 2).
"""

from __future__ import annotations

import os
import shutil


class LaunchError(Exception):
    """A launch setting (environment variable) that cannot work; printed as one line, exit 2."""


def env_int(name: str, default: int | None) -> int | None:
    """The integer environment variable ``name``; ``default`` when unset or empty.

    Raises:
        LaunchError: not a decimal integer, or below 1 (below 0 for ``NODE_RANK`` and ``MAX_RESTARTS``).
    """
    value = os.environ.get(name, "")
    if value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        number = 0
    zero_ok = name in ("NODE_RANK", "MAX_RESTARTS")
    if number < (0 if zero_ok else 1) or not value.strip().lstrip("-").isdigit():  # (negatives fail the < first)
        raise LaunchError(f"{name}={value!r} must be a {'non-negative' if zero_ok else 'positive'} "
                          f"integer; set {name} to a number or leave it unset")
    return number


def node_range() -> tuple[int, int]:
    """``NNODES`` as (min, max) nodes: ``N`` is (N, N), ``MIN:MAX`` torchrun's elastic range; unset: (1, 1).

    Raises:
        LaunchError: not a positive integer, or a range without 1 <= MIN <= MAX.
    """
    value = os.environ.get("NNODES", "")  # (any default without ':' reads NNODES again)
    if ":" not in value:
        n = env_int("NNODES", 1)
        return n, n
    low, _, high = value.partition(":")  # (one ':' in a valid range: partition = rpartition)
    if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
        raise LaunchError(f"NNODES={value!r} must be N or MIN:MAX with 1 <= MIN <= MAX, e.g. NNODES=2:4")
    return int(low), int(high)


def gpus_visible() -> int:
    """CUDA devices torch sees; torch (seconds to import) is only asked where a GPU driver exists."""
    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl"):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nproc_per_node(gpus: int) -> int:
    """Processes (ranks) to start on this node: ``NGPU``, else the ``gpus`` visible, else 2.

    Raises:
        LaunchError: ``NGPU`` set but not a positive integer.
    """
    ngpu = env_int("NGPU", None)
    return ngpu if ngpu is not None else (gpus or 2)


def torchrun_args(nproc: int, nnodes: int | tuple[int, int], entry: list[str], max_restarts: int = 0) -> list[str]:
    """torchrun's command line for this node (see engine/launch/launcher.py's docstring for the environment).

    Single node: ``--standalone`` (a private rendezvous on a free port). Several nodes: the static
    rendezvous on ``MASTER_ADDR:MASTER_PORT`` with ``--node-rank=NODE_RANK``, so global ranks follow
    the node ranks the user gave (torchrun's c10d rendezvous would rank nodes by arrival and ignore
    ``NODE_RANK``). ``nnodes`` = (MIN, MAX) with MIN < MAX: torchrun's c10d rendezvous, hosted on
    ``MASTER_ADDR:MASTER_PORT`` by that node's agent, run id ``RDZV_ID`` (default "quadra"),
    ``RDZV_CONF`` passed as ``--rdzv-conf`` (e.g. ``last_call_timeout=10``). ``max_restarts``:
    torchrun's ``--max-restarts``.

    Raises:
        LaunchError: ``NNODES > 1`` without ``MASTER_ADDR`` or ``NODE_RANK``, or a ``NODE_RANK``
            outside [0, NNODES); ``NNODES=MIN:MAX`` without ``MASTER_ADDR``.
    """
    signals = "--signals-to-handle=SIGHUP,SIGQUIT"  # TERM, USR1 and INT are ours (launcher.py's _Signals)
    low, nnodes = (nnodes, nnodes) if isinstance(nnodes, int) else nnodes
    if low < nnodes:
        addr = os.environ.get("MASTER_ADDR", "")  # (None or '': both refused)
        if not addr:
            raise LaunchError(f"NNODES={low}:{nnodes} needs MASTER_ADDR (the address of the node that hosts the "
                              "rendezvous, and must stay up); set it on every node")
        launch = [f"--nnodes={low}:{nnodes}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint={addr}:{env_int('MASTER_PORT', 29500)}",
                  f"--rdzv-id={os.environ.get('RDZV_ID') or 'quadra'}"]
        if os.environ.get("RDZV_CONF"):
            launch.append(f"--rdzv-conf={os.environ['RDZV_CONF']}")
    elif nnodes == 1:
        launch = ["--standalone", "--nnodes=1", f"--nproc-per-node={nproc}"]
    else:
        addr = os.environ.get("MASTER_ADDR", "")  # (None or '': both refused)
        node_rank = env_int("NODE_RANK", None)
        if not addr or node_rank is None:
            raise LaunchError(f"NNODES={nnodes} needs MASTER_ADDR (the first node's address) and NODE_RANK "
                              f"(this node's index, 0..{nnodes - 1}); set both on every node")
        if node_rank >= nnodes:
            raise LaunchError(f"NODE_RANK={node_rank} must be below NNODES={nnodes}; number the nodes 0..{nnodes - 1}")
        port = env_int("MASTER_PORT", 29500)
        launch = [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--nproc-per-node={nproc}",
                  "--rdzv-backend=static", f"--master-addr={addr}", f"--master-port={port}"]
    if os.environ.get("LOG_RANKS"):
        launch.append(f"--local-ranks-filter={os.environ['LOG_RANKS']}")
    return [*launch, f"--max-restarts={max_restarts}", signals, *entry]
