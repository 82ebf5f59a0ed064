"""Test-only defects that live in one layout, for tests/test_parity.py (never imported by the engine).

A test puts this folder first on ``PYTHONPATH`` of ``./scripts/parity.py``; every Python process the
sweep starts then imports this module at start-up (``site`` imports ``sitecustomize``, see the
Python docs of the ``site`` module). With ``QUADRA_TEST_DEFECT`` set, the ranks' model builder is
wrapped so that the named defect is added to the model parts after they are parallelized:

- ``tp_scale:<module>``: under tensor parallel only, ``<module>``'s forward output is multiplied
  by 1.01 (a row-parallel layer whose partial sums are reduced wrongly changes its output the same
  way: a relative error in one module that one process never has).

Without the variable, or outside torchrun's ranks (no ``RANK``), nothing is imported or changed.
"""

import os

_DEFECT = os.environ.get("QUADRA_TEST_DEFECT", "")


def _install() -> None:
    import engine.train.model_builder as builder

    kind, _, target = _DEFECT.partition(":")
    build = builder.build_model_parts

    def build_with_defect(cfg, spec, args, *, parallel_dims=None, **kwargs):
        parts, nparams, flops = build(cfg, spec, args, parallel_dims=parallel_dims, **kwargs)
        if kind == "tp_scale" and parallel_dims is not None and parallel_dims.tp > 1:
            for part in parts:
                for name, module in part.named_modules():
                    if name == target:
                        module.register_forward_hook(lambda _m, _i, out: out * 1.01)
        return parts, nparams, flops

    builder.build_model_parts = build_with_defect


if _DEFECT and "RANK" in os.environ:
    _install()
