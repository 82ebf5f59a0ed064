"""Process-group start-up: which device and backend this rank uses, read from torchrun's env.

torchrun (or SLURM through torchrun) sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
A process started without them is a single-process run and creates no process group. Each rank binds
to ``cuda:LOCAL_RANK`` with NCCL where CUDA exists, else to the CPU with gloo (torch.distributed backends docs); the
``job.device`` and ``comm.backend`` settings override the automatic choice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_DEVICE_CHOICES = ("auto", "cpu", "cuda")
_BACKEND_CHOICES = ("auto", "nccl", "gloo")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: ``rank`` of ``world_size``, ``local_rank`` on its node, its device."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None  # None: single process, no process group

    @property
    def is_distributed(self) -> bool:
        return self.backend is not None


def env_world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) when absent."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return rank, local_rank, world_size


def resolve_device(device_setting: str, local_rank: int) -> torch.device:
    """The device for this rank from ``job.device`` (auto | cpu | cuda).

    Raises:
        ValueError: an unknown setting, or ``cuda`` asked for on a machine without CUDA.
    """
    if device_setting not in _DEVICE_CHOICES:
        raise ValueError(f"job.device = {device_setting!r}: choose one of {', '.join(_DEVICE_CHOICES)}.")
    use_cuda = device_setting == "cuda" or (device_setting == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("job.device = 'cuda' but CUDA is not available here; use job.device = 'cpu'.")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"LOCAL_RANK {local_rank} has no GPU: only {torch.cuda.device_count()} visible. "
            "Launch at most one process per GPU (NGPU)."
        )
    return torch.device("cuda", local_rank)


def resolve_backend(backend_setting: str, device: torch.device) -> str:
    """The collective backend from ``comm.backend``: NCCL for CUDA, gloo for CPU by default.

    Raises:
        ValueError: an unknown setting, or NCCL asked for on the CPU.
    """
    if backend_setting not in _BACKEND_CHOICES:
        raise ValueError(f"comm.backend = {backend_setting!r}: choose one of {', '.join(_BACKEND_CHOICES)}.")
    if backend_setting == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend_setting == "nccl" and device.type != "cuda":
        raise ValueError("comm.backend = 'nccl' needs CUDA devices; use 'gloo' (or 'auto') on the CPU.")
    return backend_setting


def init_distributed(device_setting: str, backend_setting: str, timeout_seconds: int,
                     hang_timeout_seconds: int = 0) -> DistInfo:
    """Pick the device and, under torchrun, initialize the default process group.

    Args:
        device_setting: ``job.device``.
        backend_setting: ``comm.backend``.
        timeout_seconds: collective timeout (seconds): a rank that never arrives fails the run
            instead of hanging it.
        hang_timeout_seconds: ``comm.hang_timeout_seconds`` (> 0: collectives wait at least this
            + 60 s, so that the hang watchdog, engine/observe/hang.py, reports first).
    """
    if hang_timeout_seconds > 0:
        timeout_seconds = max(timeout_seconds, hang_timeout_seconds + 60)
    rank, local_rank, world_size = env_world()
    device = resolve_device(device_setting, local_rank)
    backend = resolve_backend(backend_setting, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" not in os.environ:
        return DistInfo(0, 0, 1, device, None)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(seconds=timeout_seconds),
            device_id=device if device.type == "cuda" else None,
            **_attempt_store(rank, world_size, timeout_seconds),
        )
    return DistInfo(rank, local_rank, world_size, device, backend)


def _attempt_store(rank: int, world_size: int, timeout_seconds: int) -> dict:
    """Under torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``), the store keys of this attempt.

    The agent's TCPStore outlives a restart, and ``init_process_group``'s env:// rendezvous uses it
    without a per-attempt prefix (torch 2.13 assumes a new store per retry): the ranks of a restarted
    attempt would read the addresses of the dead attempt's ranks and never connect (seen with gloo).
    A ``PrefixStore`` named by the attempt (``TORCHELASTIC_RESTART_COUNT``) and the world size (a
    group that re-forms with other nodes) keeps each attempt's keys apart. {} elsewhere: the default
    env:// rendezvous."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timedelta(seconds=timeout_seconds))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"quadra/attempt-{attempt}/world-{world_size}", store),
            "rank": rank, "world_size": world_size}


def shutdown_distributed(clean: bool = True) -> None:
    """Barrier, then destroy the process group (a barrier first avoids gloo aborts at exit).

    ``clean=False`` (the run failed, maybe because another rank died) skips the barrier, which
    could only fail again or wait for a rank that is gone.
    """
    if dist.is_available() and dist.is_initialized():
        try:
            if clean:
                dist.barrier()
        finally:
            dist.destroy_process_group()


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed because another rank went away (its process
    died or its connection closed), rather than a problem of this rank."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        mark in text for mark in ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                                  "gloo/transport", "NCCL communicator was aborted")
    )


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the launcher) dies, so that ranks never
    outlive a launcher killed hard (``kill -KILL``, the OOM killer): torchrun starts each rank in a
    session of its own, out of reach of a signal to the launcher's process group. No-op elsewhere."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)
