"""Where a training step's time goes: data, compute, exposed communication per mesh dim, bubble, optimizer.

Measured on the steps that are logged (``metrics.log_freq``), with wall clocks on the training thread:

- the trainer times its phases: ``data`` (next batch), forward/backward of all microbatches, and the
  optimizer phase (gradient clipping, ``optimizer.step``, ``zero_grad``);
- :class:`CommTimer` times the training thread while it is *blocked in communication*: inside a
  collective call and inside the wait for its result (``Work.wait`` of c10d ops, ``wait_tensor`` of
  functional collectives), per process group, and so per mesh dim. Time a collective spends
  overlapped with compute is not blocked time and is not counted: what remains is the *exposed*
  communication;
- the pipeline bubble is the pipeline runner's idle share of forward/backward minus the pp
  communication measured in it (see ``parallelisms/pipeline_timing.py``).

Then ``compute = forward/backward − communication in it − bubble``, ``optimizer = optimizer phase −
communication in it``, and ``other`` (loss reduction, bookkeeping) is what is left of the step, so the
parts sum to the step time. Logged as ``time_<part>_s`` keys in metrics.jsonl and TensorBoard.

Limits: the timer is a ``TorchDispatchMode`` (every op of a measured step passes through Python,
about +10 % on the CPU debug model; unlogged steps are not measured); collectives inside compiled
graphs are not seen by it (their time counts as compute); on CUDA, collectives run on their own
streams and the training thread waits only where it synchronizes, so ``time_comm_*`` is the host-side
blocking time; use ``[profiling]`` traces for the kernel-level view.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parallelisms.comm_counter import OPAQUE_GROUP, c10d_group_arg, functional_group_arg, group_name

# Mesh names (parallelisms/parallel_dims.py) -> the dim reported. FSDP's groups: dp_shard, or
# dp_shard_cp when cp ranks shard too, or dp_shard_mod_ep for MoE experts under ep.
REPORTED_DIM = {
    "dp_shard": "fsdp", "dp_shard_cp": "fsdp", "dp_shard_mod_ep": "fsdp",
    "dp_replicate": "ddp", "dp": "dp", "dp_cp": "dp",
    "tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp",
}
_WAIT_OPS = ("_c10d_functional.wait_tensor",)
_WRAP_OP = "_c10d_functional._wrap_tensor_autograd"  # re-wraps a result that is waited on later


class CommTimer(TorchDispatchMode):
    """Seconds the training thread is blocked in communication, per c10d group name.

    Usage: ``with CommTimer() as timer: ...``; then ``timer.seconds`` ({group name: seconds}).
    ``Work.wait`` is wrapped while the timer is active; a wait is attributed to the oldest
    outstanding c10d op of the same c10d op type (waits of one type follow their issue order).
    """

    def __init__(self):
        super().__init__()
        self.seconds: dict[str, float] = defaultdict(float)
        self._outstanding: dict[str, deque] = defaultdict(deque)  # op type -> group names
        self._tensor_groups: dict[int, str] = {}  # id() of a functional collective's result -> group
        self._original_wait = None

    def __enter__(self):
        work_cls = torch._C._distributed_c10d.Work
        self._original_wait = original = work_cls.wait
        timer = self

        def timed_wait(work, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(work, *args, **kwargs)
            finally:
                queue = timer._outstanding.get(str(work._get_op_type()))
                # inside an opaque operator (context parallel's ring) the dispatch mode saw no op
                group = queue.popleft() if queue else (OPAQUE_GROUP[0] or "unattributed")
                timer.seconds[group] += time.perf_counter() - start

        work_cls.wait = timed_wait
        return super().__enter__()

    def __exit__(self, *exc):
        torch._C._distributed_c10d.Work.wait = self._original_wait
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace = func.namespace
        if namespace not in ("c10d", "_c10d_functional"):
            return func(*args, **kwargs)
        name = f"{namespace}.{func._opname}"
        start = time.perf_counter()
        out = func(*args, **kwargs)
        elapsed = time.perf_counter() - start
        if name in _WAIT_OPS:
            group = self._tensor_groups.pop(id(args[0]), None)
            if group is None:  # a view or re-wrap of the result: the oldest outstanding one
                oldest = next(iter(self._tensor_groups), None)
                group = self._tensor_groups.pop(oldest) if oldest is not None else "unattributed"
        elif name == _WRAP_OP:
            group = self._tensor_groups.pop(id(args[0]), "unattributed")
            self._tensor_groups[id(out)] = group
        elif namespace == "c10d":
            boxed = c10d_group_arg(args)
            group = group_name(boxed) if boxed is not None else "unattributed"
            work = out[-1] if isinstance(out, (tuple, list)) else out
            if isinstance(work, torch.ScriptObject):
                op_type = str(torch._C._distributed_c10d.Work.unbox(work)._get_op_type())
                self._outstanding[op_type].append(group)
        else:
            group_arg = functional_group_arg(args, kwargs)
            group = group_name(group_arg) if isinstance(group_arg, (str, torch.ScriptObject)) else "unattributed"
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self._tensor_groups[id(tensor)] = group  # alive until waited on
        self.seconds[group] += elapsed
        return out


def comm_seconds_by_dim(seconds: dict[str, float], group_dims: dict[str, str]) -> dict[str, float]:
    """{reported dim: seconds} from a :class:`CommTimer`'s per-group seconds; ``group_dims`` maps a
    c10d group name to its mesh name (``parallelisms.comm_counter.group_names_by_mesh_dim``). Groups
    of no mesh (e.g. the default world group) are reported as ``other``."""
    by_dim: dict[str, float] = defaultdict(float)
    for group, value in seconds.items():
        by_dim[REPORTED_DIM.get(group_dims.get(group, ""), "other")] += value
    return dict(by_dim)


def step_attribution(*, step_s: float, data_s: float, forward_backward_s: float, optimizer_s: float,
                     comm_forward_backward: dict[str, float], comm_optimizer: dict[str, float],
                     idle_s: float = 0.0) -> dict[str, float]:
    """The ``time_*_s`` record of one step (seconds; the parts sum to ``step_s``).

    Args:
        step_s: the whole step; data_s: waiting for the batch; forward_backward_s: all microbatches'
            forward and backward; optimizer_s: clipping + optimizer step + zero_grad.
        comm_forward_backward / comm_optimizer: {dim: exposed communication seconds} in each phase.
        idle_s: pipeline runner's idle time in forward/backward (0 without pipeline parallel).
    """
    comm: dict[str, float] = defaultdict(float)
    for part in (comm_forward_backward, comm_optimizer):
        for dim, value in part.items():
            comm[dim] += value
    bubble = max(0.0, idle_s - comm_forward_backward.get("pp", 0.0))
    record = {
        "time_step_s": step_s,
        "time_data_s": data_s,
        "time_compute_s": max(0.0, forward_backward_s - sum(comm_forward_backward.values()) - bubble),
        "time_bubble_s": bubble,
        "time_optimizer_s": max(0.0, optimizer_s - sum(comm_optimizer.values())),
    }
    record.update({f"time_comm_{dim}_s": value for dim, value in sorted(comm.items())})
    record["time_other_s"] = step_s - sum(v for k, v in record.items() if k != "time_step_s")
    return record


class StepTimer:
    """The timing scaffolding of one training step, so that ``Trainer.train_step`` reads as its recipe.

    Each :meth:`phase` ("data", "forward_backward", "optimizer") is timed with :meth:`clock`; on an
    attributed step (``measure``) the clock first waits for the device's queued work (CUDA kernels run
    asynchronously) and, with a process group, the forward-backward and optimizer phases run under a
    :class:`CommTimer` each, whose collective wait times :meth:`phases` groups per mesh dim.

    Args:
        measure: whether this step is attributed (a logged step with ``metrics.time_attribution``).
        device: the training device; distributed: whether a process group exists.
        group_dims: process-group name -> mesh dim (``parallelisms.comm_counter.group_names_by_mesh_dim``).
    """

    TIMED_COMM = ("forward_backward", "optimizer")

    def __init__(self, *, measure: bool, device: torch.device, distributed: bool, group_dims: dict[str, str]):
        self.measure = measure
        self._device = device
        self._group_dims = group_dims
        self._comm = {name: CommTimer() for name in self.TIMED_COMM} if measure and distributed else {}
        self.seconds: dict[str, float] = {}

    def clock(self) -> float:
        """perf_counter, after the device's queued work on attributed steps (seconds)."""
        if self.measure and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def phase(self, name: str) -> "_Phase":
        """A context manager timing phase ``name`` into ``seconds[name]`` (module docstring)."""
        return _Phase(self, name)

    def phases(self, idle_s: float) -> dict:
        """The keyword arguments of :func:`step_attribution` but ``step_s``: the phases' seconds, the
        communication seconds per mesh dim of forward-backward and optimizer, and ``idle_s`` (the
        pipeline bubble's seconds)."""
        comm = {name: comm_seconds_by_dim(timer.seconds, self._group_dims) for name, timer in self._comm.items()}
        return {"data_s": self.seconds["data"], "forward_backward_s": self.seconds["forward_backward"],
                "optimizer_s": self.seconds["optimizer"], "comm_forward_backward": comm.get("forward_backward", {}),
                "comm_optimizer": comm.get("optimizer", {}), "idle_s": idle_s}


class _Phase:
    """One :meth:`StepTimer.phase`: its CommTimer (if any) around the timed block."""

    def __init__(self, timer: StepTimer, name: str):
        self._timer, self._name = timer, name
        self._comm = timer._comm.get(name)

    def __enter__(self):
        if self._comm is not None:
            self._comm.__enter__()
        self._start = self._timer.clock()
        return self

    def __exit__(self, *exc):
        self._timer.seconds[self._name] = self._timer.clock() - self._start
        if self._comm is not None:
            self._comm.__exit__(*exc)
        return False
