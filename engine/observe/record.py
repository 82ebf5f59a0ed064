"""Record one optimizer step on every rank: each named module's forward input and output, and each
parameter's reduced gradient, for the first-divergence locator (engine/parity/assemble.py,
``./scripts/parity.py --locate``). Off unless ``[record] step`` > 0.

What a rank writes to ``<run folder>/<record.folder>/rank-<r>.pt`` (``torch.save`` of a dict):

- ``coords``: this rank's place in the layout: ``{"pp", "dp", "dp_size", "cp", "cp_size", "tp",
  "tp_size"}`` (local ranks and sizes of the pp, dp (replicate × shard), cp and tp meshes);
  ``positions``: LongTensor [seq_len / cp], the global token positions this cp rank holds (None
  without context parallel; parallelisms/context_parallel.py ``cp_positions``).
- ``inputs``: the step's microbatches as loaded, LongTensor [local_batch_size, seq_len] each, before
  context-parallel sharding: they name the samples this rank trained, whole.
- ``modules``: ``{name: {"out": [call, ...], "in": [call, ...]}}`` for every forward call of every
  named module of this rank's model parts (activation-checkpoint recomputation and pipeline shape
  inference excluded), in call
  order; a call is ``{"t": tensor (CPU, detached), "shard": dim or None, "partial": bool,
  "counts": LongTensor [E] or None}``: a DTensor is stored as its local tensor with the dim it is
  sharded on over the tp mesh (``shard``) or whether it is a partial sum; ``counts`` is the
  per-group row count passed to modules whose forward is ``(rows grouped by expert, counts)``
  (models/common/moe.py ``GroupedExperts``), taken before expert parallel's dispatch.
- ``order``: module names in the order their first output was produced (forward order);
- ``grads``: ``{param name: full gradient}`` (``DTensor.full_tensor()``), written by the rank whose
  dp, cp and tp local ranks are 0 (one per pipeline rank); ``grad_order``: parameter names in the
  order backward produced their gradients (the first microbatch's), from that same rank.

Names drop the wrappers' components (``_checkpoint_wrapped_module``, ``_orig_mod``), so they match
across layouts and activation-checkpoint modes.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from parallelisms.pipeline import in_shape_inference

WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def clean_name(name: str) -> str:
    """A module or parameter name without the wrappers' components (see the module docstring):
    ``layers.0._checkpoint_wrapped_module.attention`` -> ``layers.0.attention``."""
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def _not_training_forward() -> bool:
    """True for a forward that trains nothing: activation-checkpoint recomputation (autograd's engine
    is running) or a pipeline stage's shape inference (parallelisms/pipeline.py)."""
    return torch._C._current_graph_task_id() != -1 or in_shape_inference()


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


def _call_record(tensor: torch.Tensor, tp_mesh_dim: str = "tp") -> dict | None:
    """``tensor`` as a call record (module docstring), or None for a meta tensor (pipeline shape
    inference runs a forward on the meta device)."""
    from torch.distributed.tensor import DTensor

    shard, partial = None, False
    if isinstance(tensor, DTensor):
        names = tensor.device_mesh.mesh_dim_names or ()
        for dim_name, placement in zip(names, tensor.placements):
            if dim_name == tp_mesh_dim and placement.is_shard():
                shard = placement.dim
            partial = partial or placement.is_partial()
        tensor = tensor.to_local()
    if tensor.is_meta:
        return None
    return {"t": tensor.detach().to("cpu", copy=True), "shard": shard, "partial": partial, "counts": None}


class StepRecorder:
    """Records ``[record] step`` (see the module docstring); a no-op object for every other step.

    Args:
        section: the ``[record]`` config section; run_folder: the run's folder.
        model_parts: this rank's model parts; parallel_dims: the run's degrees and meshes
            (parallelisms/parallel_dims.py); context_parallel: its ``ContextParallel`` or None.
        rank: the global rank.

    Usage: ``begin(step, batches)`` before the step's forward, ``end(model_parts)`` after its backward
    (before clipping). ``end`` runs collectives (``full_tensor`` of sharded gradients) on every rank.
    """

    def __init__(self, section, run_folder: str, model_parts: list[nn.Module], parallel_dims,
                 context_parallel, rank: int):
        self.step = section.step
        self.folder = os.path.join(run_folder, section.folder)
        self.model_parts, self.rank = model_parts, rank
        self.coords = _coords(parallel_dims)
        self.positions = None if context_parallel is None else context_parallel.local_positions.clone()
        self._handles: list = []
        self._data: dict | None = None

    def active(self, step: int) -> bool:
        """Whether ``step`` (1-based) is the recorded one."""
        return self.step > 0 and step == self.step

    def begin(self, step: int, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Start recording if ``step`` is the recorded one: keep the inputs of ``batches`` ([B, S]
        inputs and labels per microbatch) and hook every named module."""
        if not self.active(step):
            return
        self._data = {"rank": self.rank, "step": step, "coords": self.coords, "positions": self.positions,
                      "inputs": [inputs.detach().to("cpu", copy=True) for inputs, _ in batches],
                      "modules": {}, "order": [], "grads": {}, "grad_order": []}
        for part in self.model_parts:
            for name, module in part.named_modules():
                name = clean_name(name)
                if not name or type(module).__name__ in ("CheckpointWrapper", "OptimizedModule"):
                    continue
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(name), prepend=True))
                self._handles.append(module.register_forward_hook(self._post_hook(name)))
            if self._writes_grads():
                for name, param in part.named_parameters():
                    if param.requires_grad:
                        hook = self._grad_hook(clean_name(name))
                        self._handles.append(param.register_post_accumulate_grad_hook(hook))

    def _writes_grads(self) -> bool:
        c = self.coords
        return c["dp"] == 0 and c["cp"] == 0 and c["tp"] == 0

    def _pre_hook(self, name: str):
        def hook(module, args):
            if _not_training_forward():
                return
            entry = self._data["modules"].setdefault(name, {"out": [], "in": [], "counts": None})
            tensor = _first_tensor(args)
            record = None if tensor is None else _call_record(tensor)
            if record is not None:
                counts = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
                if counts is not None and counts.dim() == 1 and not counts.is_floating_point() \
                        and int(counts.sum()) == record["t"].shape[0]:
                    record["counts"] = counts.detach().to("cpu", copy=True)
                entry["in"].append(record)
            entry["counts"] = record["counts"] if record is not None else None  # for this call's output
        return hook

    def _post_hook(self, name: str):
        def hook(module, args, output):
            if _not_training_forward():
                return
            tensor = _first_tensor(output)
            record = None if tensor is None else _call_record(tensor)
            if record is None:
                return
            entry = self._data["modules"][name]
            if entry["counts"] is not None and record["t"].shape[0] == int(entry["counts"].sum()):
                record["counts"] = entry["counts"]
            entry["out"].append(record)
            if name not in self._data["order"]:
                self._data["order"].append(name)
        return hook

    def _grad_hook(self, name: str):
        def hook(param):
            if name not in self._data["grad_order"]:
                self._data["grad_order"].append(name)
        return hook

    def end(self) -> None:
        """After the recorded step's backward: gather gradients, remove the hooks, write this rank's
        file (a no-op on other steps). Every rank must call it (``full_tensor`` is a collective)."""
        if self._data is None:
            return
        from torch.distributed.tensor import DTensor

        for handle in self._handles:
            handle.remove()
        self._handles = []
        writes = self._writes_grads()
        for part in self.model_parts:
            for name, param in part.named_parameters():
                grad = param.grad
                if grad is None:
                    continue
                full = grad.full_tensor() if isinstance(grad, DTensor) else grad
                if writes:
                    self._data["grads"][clean_name(name)] = full.detach().to("cpu", copy=True)
        for entry in self._data["modules"].values():
            entry.pop("counts", None)
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"rank-{self.rank}.pt")
        torch.save(self._data, path + ".tmp")
        os.replace(path + ".tmp", path)
        self._data = None


def _coords(parallel_dims) -> dict:
    """This rank's local rank and size on the pp, dp, cp and tp meshes (0 and 1 for one process)."""
    coords = {"pp": 0, "dp": 0, "dp_size": 1, "cp": 0, "cp_size": 1, "tp": 0, "tp_size": 1}
    if parallel_dims is None or not parallel_dims.mesh_built:
        return coords
    for key in ("pp", "dp", "cp", "tp"):
        mesh = parallel_dims.mesh(key)
        coords[key] = mesh.get_local_rank()
        if key != "pp":
            coords[f"{key}_size"] = mesh.size()
    return coords
