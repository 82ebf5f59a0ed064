"""The peak memory of a training step by kind, measured with torch's ``MemTracker``
(torch/distributed/_tools/mem_tracker.py): what engine/planner's activation, transient and gradient
reduction estimates predict, for tests/planner_runs.py and scripts/benchmarks/runs.py.
"""

from __future__ import annotations


def local_bytes(tensors) -> int:
    """Bytes of this rank's part of ``tensors`` (a DTensor's local shard, a plain tensor whole)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def peak_tracker(trainer):
    """A torch ``MemTracker`` over the model parts and the optimizer that, at every tensor allocation
    of the step it is entered around, records two peaks (bytes):

    - ``activation_peak``: the largest sum of the categories ACT + TEMP + OTH (every live tensor that
      is not a parameter, buffer, gradient or optimizer state): the planner's ``activations``;
    - ``transient_peak``: the largest sum of every live tensor byte that is not the rank's own state
      (its parameter shards, the gradients of those shards alive at that moment, optimizer state,
      buffers). FSDP2 / ``replicate`` register the all-gathered (unsharded) parameters as the
      module's parameters, so ``MemTracker`` counts them as PARAM, and their accumulated gradients as
      GRAD; reduce-scatter / all-reduce buffers are allocated in backward and count as TEMP. This is
      what the planner's ``peak_nonstate_bytes`` predicts;
    - ``reduction_peak``: the same sum, only while an FSDP2 / ``replicate`` parameter group runs its
      ``post_backward`` (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py: reshard, gradient
      copy-in, reduce-scatter, all-reduce): what engine/planner/reduction.py predicts. The method is
      wrapped while the tracker is entered (the ranks are forked test processes).

    ``MemTracker`` refuses a second forward of a root module (accumulation and pipeline
    microbatches call it several times); those calls are let through, the peaks are still tracked.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    params = [p for part in trainer.model_parts for p in part.parameters()]
    held_params = local_bytes(params)
    # A gradient has its parameter's local shape (tests/training_utils.py gradient_placement_errors):
    # its bytes are known in advance, so each allocation only checks which gradients exist.
    grad_bytes = [(p, local_bytes([p])) for p in params]

    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    class _RepeatedCalls(MemTracker):
        activation_peak = 0
        transient_peak = 0
        reduction_peak = 0
        in_reduction = False

        def _update_peak_stats(self, peak_state) -> None:
            # MemTracker's own per-module and per-device peaks (deep copies of the snapshot, for every
            # tracked module, at every allocation) are never read here: they cost half the measured
            # step. The three peaks below need only the current snapshot.
            for categories in self._curr_mem_snap.values():
                named = {str(c).rsplit(".", 1)[-1]: b for c, b in categories.items()}
                live = named.get("ACT", 0) + named.get("TEMP", 0) + named.get("OTH", 0)
                self.activation_peak = max(self.activation_peak, live)
                state = held_params + sum(size for p, size in grad_bytes if p.grad is not None)
                other = named.get("PARAM", 0) + named.get("GRAD", 0) - state
                self.transient_peak = max(self.transient_peak, live + other)
                if self.in_reduction:
                    self.reduction_peak = max(self.reduction_peak, live + other)

        def __enter__(self):
            original = FSDPParamGroup.post_backward
            tracker = self

            def post_backward(group, *args, **kwargs):
                tracker.in_reduction = True
                try:
                    return original(group, *args, **kwargs)
                finally:
                    tracker.in_reduction = False

            self._original_post_backward = original
            FSDPParamGroup.post_backward = post_backward
            return super().__enter__()

        def __exit__(self, *exc):
            FSDPParamGroup.post_backward = self._original_post_backward
            return super().__exit__(*exc)

        def _pre_fw_hook(self, module, inputs):
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:  # the root module's next microbatch
                pass

    tracker = _RepeatedCalls()
    tracker.track_external(*trainer.model_parts, trainer.optimizer)
    return tracker
