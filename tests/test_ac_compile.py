"""Activation checkpointing and per-block compile change memory and speed, never the numbers."""

from __future__ import annotations

import dataclasses

import pytest

from tests.dist_utils import run_distributed
from tests.training_utils import assert_parity, base_args, train_and_record

pytestmark = pytest.mark.slow  # multi-process training (see pyproject.toml)

AC_MODES = {
    "full": {"activation_checkpoint.mode": "full"},
    "selective_every_2": {"activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": "2"},
    "selective_op": {"activation_checkpoint.mode": "selective", "activation_checkpoint.selective_ac_option": "op"},
    "selective_op_all_matmuls": {"activation_checkpoint.mode": "selective",
                                 "activation_checkpoint.selective_ac_option": "op_all_matmuls"},
}


@pytest.mark.parametrize("mode", sorted(AC_MODES))
def test_activation_checkpointing_parity(mode, reference, tmp_path):
    argv = base_args(str(tmp_path), AC_MODES[mode])
    (history,) = run_distributed(train_and_record, 1, argv, torchrun_env=False)
    assert_parity(history, reference)


def test_activation_checkpointing_with_fsdp(reference, tmp_path):
    overrides = {"parallelism.dp_shard": 2, "training.local_batch_size": 4, **AC_MODES["selective_op"]}
    for history in run_distributed(train_and_record, 2, base_args(str(tmp_path), overrides)):
        assert_parity(history, reference)


def _recomputed_blocks(mode: str, option: str) -> int:

    from models import get_model_args, get_model_spec
    from models.registry import load_ref
    from parallelisms.activation_checkpoint import apply_activation_checkpointing

    model = load_ref(get_model_spec("llama").model_cls)(get_model_args("llama", "debugmodel"))
    return apply_activation_checkpointing(model, mode, option)


@pytest.mark.parametrize("mode, option, wrapped", [("none", "op", 0), ("full", "op", 6), ("selective", "2", 3), ("selective", "op", 6)])
def test_blocks_wrapped(mode, option, wrapped):
    assert _recomputed_blocks(mode, option) == wrapped


@pytest.mark.parametrize("mode, option, recomputed, fewer_saved", [
    ("none", "op", [0] * 6, False),
    ("full", "op", [1] * 6, True),
    ("selective", "2", [1, 0, 1, 0, 1, 0], True),  # every 2nd block, counting from the first
    ("selective", "op", [1] * 6, True),  # op-level: the block reruns, matmul outputs come from the cache
    ("selective", "op_all_matmuls", [1] * 6, True),
])
def test_backward_recomputes_the_checkpointed_blocks(mode, option, recomputed, fewer_saved):
    """What activation checkpointing is for: backward runs the wrapped blocks' forward again, and
    forward keeps fewer tensors for backward (counted with saved_tensors_hooks)."""
    import torch

    from models import get_model_args
    from models.llama.model import Transformer
    from parallelisms.activation_checkpoint import apply_activation_checkpointing

    def build():
        torch.manual_seed(0)
        model = Transformer(dataclasses.replace(get_model_args("llama", "debugmodel"), max_seq_len=16))
        model.init_weights(seed=0)
        return model

    def run(model):
        calls = [0] * len(model.layers)
        for index, block in enumerate(model.layers.values()):
            # A pre-hook: recomputation stops early, once the last tensor backward needs is back,
            # so a forward hook (after forward returns) would not fire on it.
            block.feed_forward.register_forward_pre_hook(lambda *_, i=index: calls.__setitem__(i, calls[i] + 1))
        saved = [0]

        def pack(tensor):
            saved[0] += 1
            return tensor

        tokens = torch.randint(0, 4096, (1, 16))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(tokens).float().logsumexp(-1).sum()
        forward_calls = list(calls)
        loss.backward()
        return [c - f for c, f in zip(calls, forward_calls)], saved[0]

    _, saved_plain = run(build())
    model = build()
    apply_activation_checkpointing(model, mode, option)
    again, saved = run(model)
    assert again == recomputed
    assert (saved < saved_plain) == fewer_saved, (saved, saved_plain)


def _block_ops_in_backward(option: str, tp: int = 1):
    """(names of the matmuls and attention ops run in backward's recomputation, by block: ``mm``
    calls whose output width says which weight; forward's saved op outputs) of one debug-model
    step with per-op ``option``, counted with a dispatch mode around backward."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from models import get_model_args
    from models.llama.model import Transformer
    from parallelisms.activation_checkpoint import apply_activation_checkpointing

    args = dataclasses.replace(get_model_args("llama", "debugmodel"), max_seq_len=16)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(seed=0)
    apply_activation_checkpointing(model, "selective", option)
    widths = {args.dim: "wq|wo|w2", args.n_kv_heads * args.dim // args.n_heads: "wk|wv",
              model.layers["0"].feed_forward.w1.out_features: "w1|w3"}

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default and args[0].shape[0] == 16:  # [tokens, in] @ [in, out]
                self.ops.append(widths.get(out.shape[1], str(out.shape[1])))
            elif "scaled_dot_product" in str(func) and "backward" not in str(func):
                self.ops.append("attention")
            return out

    loss = model(torch.randint(0, args.vocab_size, (1, 16))).logsumexp(-1).sum()
    with Ops() as ops:
        loss.backward()
    return ops.ops


def test_op_recomputes_every_second_matmul():
    """TorchTitan's "op": of a block's seven matmuls (wq, wk, wv, wo, w1, w3, w2) the 2nd, 4th and
    6th (wk, wo, w3) run again in backward, the others and attention come from the cache; the
    counter restarts at every block, so each of the six blocks recomputes the same three."""
    recomputed = _block_ops_in_backward("op")
    # Backward's own input gradients are [tokens, in] matmuls too: the difference with
    # "op_all_matmuls", which recomputes no matmul, is what "op" recomputes.
    kept_all = _block_ops_in_backward("op_all_matmuls")
    extra = list(recomputed)
    for op in kept_all:
        extra.remove(op)
    assert sorted(extra) == sorted(["wk|wv", "wq|wo|w2", "w1|w3"] * 6), extra
    assert "attention" not in recomputed and "attention" not in kept_all


@pytest.mark.parametrize("option", ["0", "x", "-1"])
def test_bad_selective_option(option):
    with pytest.raises(ValueError, match="activation_checkpoint.selective_ac_option"):
        _recomputed_blocks("selective", option)


def test_compile_parity(reference, tmp_path):
    """Inductor-compiled blocks (C++ codegen on the CPU) match eager to float tolerance."""
    argv = base_args(str(tmp_path), {"compile.enable": "true"})
    (history,) = run_distributed(train_and_record, 1, argv, torchrun_env=False, timeout=400)
    assert_parity(history, reference)
