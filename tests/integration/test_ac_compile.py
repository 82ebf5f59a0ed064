"""Activation checkpointing and per-block compile change memory and speed, never the numbers."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from engine.testing.processes import run_distributed
from tests.training_utils import assert_parity, base_args, quadra_log_lines, train_and_record


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
    from models.common.decoder import Transformer
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


def _forward_matmuls_in_backward(option: str) -> list[str]:
    """The forward matmuls run again in backward (the recomputation) of one debug-model step under
    per-op ``option``, as "<block>.<weight>" names: a forward matmul is ``mm(x, W.t())``, whose
    second argument is the transposed view of a weight (backward's ``dX = dY @ W`` takes W itself),
    counted with a dispatch mode around backward. Also "attention" for a forward SDPA kernel."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from models import get_model_args
    from models.common.decoder import Transformer
    from parallelisms.activation_checkpoint import apply_activation_checkpointing

    args = dataclasses.replace(get_model_args("llama", "debugmodel"), max_seq_len=16)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights(seed=0)
    weights = {p.untyped_storage().data_ptr(): name.rsplit(".", 1)[0].replace(".attention", "").replace(".feed_forward", "")
               for name, p in model.named_parameters() if name.endswith(".weight") and p.ndim == 2}
    apply_activation_checkpointing(model, "selective", option)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mm.default and not args[1].is_contiguous():
                name = weights.get(args[1].untyped_storage().data_ptr())
                if name is not None:
                    self.ops.append(name.replace("layers.", ""))
            elif "scaled_dot_product" in str(func) and "backward" not in str(func):
                self.ops.append("attention")
            return func(*args, **(kwargs or {}))

    loss = model(torch.randint(0, args.vocab_size, (1, 16))).logsumexp(-1).sum()
    with Ops() as ops:
        loss.backward()
    return ops.ops


@pytest.mark.parametrize("option, recomputed", [
    ("op", ("wk", "wo", "w3")),  # TorchTitan's: the 2nd, 4th and 6th of wq, wk, wv, wo, w1, w3, w2
    ("op_all_matmuls", ()),
])
def test_per_op_policy_recomputes_its_matmuls(option, recomputed):
    """Which forward matmuls backward runs again, by name, in every one of the six blocks: the
    counter restarts at each block (a shared one would shift the odd ones by one, 7 being odd), and
    attention always comes from the cache."""
    want = sorted(f"{block}.{w}" for block in range(6) for w in recomputed)
    assert sorted(_forward_matmuls_in_backward(option)) == want


@pytest.mark.parametrize("option", ["0", "x", "-1"])
def test_bad_selective_option(option):
    with pytest.raises(ValueError, match="activation_checkpoint.selective_ac_option"):
        _recomputed_blocks("selective", option)


def test_compile_parity(reference, tmp_path):
    """Inductor-compiled blocks (C++ codegen on the CPU) match eager to float tolerance."""
    argv = base_args(str(tmp_path), {"compile.enable": "true"})
    (history,) = run_distributed(train_and_record, 1, argv, torchrun_env=False, timeout=400)
    assert_parity(history, reference)


def _compile_setup(argv: list[str]) -> tuple[list[str], bool]:
    """Build a Trainer (no step): (its "compile (" log lines, AOTAutograd's cache switch after it)."""
    import torch._functorch.config

    from engine.config import load_config
    from engine.train.trainer import Trainer

    with quadra_log_lines("compile (") as lines:
        Trainer(load_config(argv)).close()
    return [message for _, message in lines], torch._functorch.config.enable_autograd_cache


def test_compile_says_what_it_compiles_and_ranks_keep_no_shared_autograd_cache(tmp_path):
    """One line names the backend and the modules compiled (the MoE debug flavor's 1 dense block, and
    attention, router and shared experts of each of its 3 MoE blocks: 10). With several ranks
    AOTAutograd's on-disk cache is off: its key misses the process-group names baked into the code,
    so the ranks of different tp groups loaded each other's graphs (parallelisms/compile.py); one
    process keeps it."""
    overrides = {"model.name": "moe", "model.flavor": "debugmodel", "compile.enable": "true"}
    ((lines, cache_on),) = run_distributed(_compile_setup, 1, base_args(str(tmp_path / "one"), overrides),
                                           torchrun_env=False)
    assert cache_on and len(lines) == 1 and lines[0].startswith(
        "compile (inductor, fullgraph): 10 modules per rank: 1 whole block; 3 MoE blocks by their attention"), lines
    for lines, cache_on in run_distributed(_compile_setup, 2, base_args(str(tmp_path / "two"), {
            **overrides, "parallelism.dp_shard": 1, "parallelism.tp": 2})):
        assert not cache_on and len(lines) == 1 and ": 10 modules per rank" in lines[0], lines


def test_compile_summary_names_dense_blocks_and_the_ring():
    """A dense model's line speaks of whole blocks, not MoE parts, and under cp of the eager ring."""
    from torch import nn

    from parallelisms.compile import compile_summary

    block = nn.Module()
    block.attention, block.feed_forward = nn.Linear(2, 2), nn.Linear(2, 2)
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": block, "1": copy.deepcopy(block)})
    line = compile_summary([model], "inductor", cp=2)
    assert line == ("compile (inductor, fullgraph): 2 modules per rank: 2 whole blocks; the ring attention (cp 2) "
                    "is one opaque operator inside them, its send/recv eager; the first step compiles"), line
    assert "MoE" not in compile_summary([model], "inductor") and "ring" not in compile_summary([model], "inductor")
