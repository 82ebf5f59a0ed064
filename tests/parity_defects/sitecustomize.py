"""Test-only defects that live in one layout, for tests/integration/test_parity*.py (never imported by the engine).

A test puts this folder first on ``PYTHONPATH`` of ``./scripts/parity.py``; every Python process the
sweep starts then imports this module at start-up (``site`` imports ``sitecustomize``, see the
Python docs of the ``site`` module). With ``QUADRA_TEST_DEFECT`` set to ``kind:module[@step]``
entries (comma-separated), the ranks' model builder is wrapped so that each defect is added to the
named module after the model is parallelized, from training step ``step`` on (default 1):

- ``tp_scale:<module>``: under tensor parallel, the module's output × 1.01;
- ``tp_unreduced:<module>``: under tensor parallel, a row-parallel linear layer returns this rank's
  partial product (its input shard times its weight shard) instead of the sum over the tp ranks: a
  missing all-reduce / reduce-scatter;
- ``cp_rope_offset:<module>``: under context parallel, on cp rank 1, the attention module gets RoPE
  tables shifted by one position;
- ``pp_scale:<module>``: under pipeline parallel, the module (on whichever stage holds it) × 1.01;
- ``ep_drop:<module>``: under expert parallel, on ep rank 1, the output rows of its first local
  expert are zeroed before they are sent back (that expert's output is dropped);
- ``dp_grad_scale:<parameter>``: under data parallel without ep, on dp rank 1, the parameter's
  local gradient is doubled after backward (a wrong gradient reduction: the forward is untouched);
- ``float8_local_amax:*``: under FSDP with float8 all-gather, each rank scales its float8 weight
  shards by its own shard's amax (torchao's amax all-reduce off, no precomputed scales) instead of
  the whole weight's (from step 1; the target is not read).

Without the variable, or outside torchrun's ranks (no ``RANK``), nothing is imported or changed.
"""

import os

_DEFECTS = os.environ.get("QUADRA_TEST_DEFECT", "")
_STEP = [0]  # the training step running now (1-based), set by the wrapped Trainer.train_step


def _parse():
    for entry in filter(None, _DEFECTS.split(",")):
        kind, _, rest = entry.partition(":")
        target, _, step = rest.partition("@")
        yield kind, target, int(step or 1)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _like(value, output):
    """``value`` (a plain tensor) in the form of ``output`` (a DTensor keeps its mesh and placements)."""
    if hasattr(output, "device_mesh"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(value, output.device_mesh, output.placements, run_check=False)
    return value


def _hooks(kind, dims, from_step):
    """(register method name, hook, extra kwargs) for a defect on this rank, or None."""
    import torch
    import torch.nn.functional as F

    def active():
        return _STEP[0] >= from_step

    def rank(mesh):
        return dims.mesh(mesh).get_local_rank()

    if kind in ("tp_scale", "pp_scale") and getattr(dims, kind[:2]) > 1:
        return "register_forward_hook", lambda m, i, out: out * 1.01 if active() else None, {}
    if kind == "tp_unreduced" and dims.tp > 1:
        def unreduced(module, args, out):
            if not active():
                return None
            partial = F.linear(_local(args[0]), _local(module.weight))
            local = _local(out)
            if local.shape[1] != partial.shape[1]:  # sequence parallel: this rank's rows of the sum
                rows = local.shape[1]
                partial = partial[:, rank("tp") * rows:(rank("tp") + 1) * rows]
            return _like(partial.contiguous(), out)
        return "register_forward_hook", unreduced, {}
    if kind == "cp_rope_offset" and dims.cp > 1 and rank("cp") == 1:
        def offset(module, args):
            if not active():
                return None
            x, cos, sin, *rest = args
            return (x, torch.roll(cos, 1, dims=0), torch.roll(sin, 1, dims=0), *rest)
        return "register_forward_pre_hook", offset, {}
    if kind == "ep_drop" and dims.ep > 1 and rank("ep") == 1:
        def drop(module, args, out):  # runs before expert parallel's combine: rows of the local experts
            if not active():
                return None
            out = out.clone()
            out[: int(args[1][0])] = 0
            return out
        return "register_forward_hook", drop, {"prepend": True}
    return None


def _scale_gradient(trainer, target: str, from_step: int) -> None:
    """Double ``target``'s local gradient after each step's backward (before clipping and recording)."""
    from engine.observe.record import clean_name

    step = trainer.runner.step

    def scaled(microbatches, global_tokens):
        loss = step(microbatches, global_tokens)
        if _STEP[0] >= from_step:
            for part in trainer.model_parts:
                for name, param in part.named_parameters():
                    if clean_name(name) == target and param.grad is not None:
                        _local(param.grad).mul_(2.0)
        return loss

    trainer.runner.step = scaled


def _install() -> None:
    import engine.setup.model_builder as builder

    build = builder.build_model_parts

    from engine.observe.record import clean_name

    def build_with_defects(cfg, spec, args, *, parallel_dims=None, **kwargs):
        parts, nparams, flops = build(cfg, spec, args, parallel_dims=parallel_dims, **kwargs)
        for kind, target, from_step in _parse():
            hook = _hooks(kind, parallel_dims, from_step) if parallel_dims is not None else None
            if hook is None:
                continue
            method, fn, options = hook
            for part in parts:
                for name, module in part.named_modules():
                    if clean_name(name) == target:
                        getattr(module, method)(fn, **options)
        return parts, nparams, flops

    builder.build_model_parts = build_with_defects
    import engine.train.trainer as trainer  # after the patch: it imports build_model_parts by name

    train_step = trainer.Trainer.train_step

    def counting_train_step(self):
        _STEP[0] = self.step + 1
        if not getattr(self, "_defects_wrapped", False):
            self._defects_wrapped = True
            dims = self.parallel_dims
            for kind, target, from_step in _parse():
                if kind == "dp_grad_scale" and dims.dp > 1 and dims.ep == 1 and dims.mesh("dp").get_local_rank() == 1:
                    _scale_gradient(self, target, from_step)
        return train_step(self)

    trainer.Trainer.train_step = counting_train_step
    if any(kind == "float8_local_amax" for kind, _, _ in _parse()):
        local_float8_amax()


def local_float8_amax():
    """The ``float8_local_amax`` defect, installed in this process: torchao's amax all-reduce switched
    off and no precomputed scales, so each FSDP rank scales its float8 weight shard by its own shard's
    amax instead of the whole weight's (also tests/integration/test_float8.py's local-shard run). Returns a function
    that puts torchao's and the runner's own back."""
    import torchao.float8.float8_utils as utils

    import engine.train.runner as runner

    amax, precompute = utils.tensor_to_amax, runner.precompute_float8_scales
    utils.tensor_to_amax = lambda x, reduce_amax=False, *a, **k: amax(x, False, *a, **k)
    runner.precompute_float8_scales = lambda parts: None

    def restore() -> None:
        utils.tensor_to_amax, runner.precompute_float8_scales = amax, precompute

    return restore


if _DEFECTS and "RANK" in os.environ:
    _install()
