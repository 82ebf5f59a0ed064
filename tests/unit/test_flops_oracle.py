"""The one FLOPs formula (models/common/shapes.py ``training_flops_per_token``, what MFU and the planner
divide by) against torch's own count of a real training step: ``torch.utils.flop_counter.FlopCounterMode``
over the forward and backward of every family's debug flavors, fp32 on the CPU, per token.

The two agree exactly once the conventions are lined up: PaLM's 6N (Chowdhery et al. 2022, App. B)
counts every parameter, RMSNorm weights included, while the counter counts matmuls only, so the
formula's 6 · (norm weights) is taken off; SDPA runs its math path (the counter has no formula for the
CPU flash kernel) and the routed experts their per-expert loop (none for ``torch._grouped_mm``; the
loop does the same products), and the fused loss's in-place ``addmm_`` of the head's gradient is
given the formula of ``addmm``."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from models.registry import get_model_spec

SEQ_LEN = 32
CASES = [("llama", "debugmodel"), ("qwen3", "debugmodel_tiny"), ("moe", "debugmodel"), ("qwen3_moe", "debugmodel_tiny"),
         ("deepseek_v3", "debugmodel"), ("deepseek_v3", "debugmodel_noqlora"), ("deepseek_v3", "debugmodel_mtp")]


def _addmm_(self_shape, a, b, out_shape=None, **kwargs) -> int:
    """FLOPs of ``self.addmm_(a, b)``: 2 · a[0] · a[1] · b[1], as torch's own ``addmm`` formula."""
    return 2 * a[0] * a[1] * b[1]


def counted_flops_per_token(name: str, flavor: str) -> float:
    """FlopCounterMode's FLOPs of one training step (forward with the model's loss, backward) per token."""
    spec = get_model_spec(name)
    args = spec.flavors[flavor]
    model = spec.get("model_cls")(args)
    model.init_weights(seed=0)
    if hasattr(model, "mtp_weight"):
        model.mtp_weight = 0.3  # the multi-token-prediction depths run only when weighted
    for module in model.modules():
        if hasattr(module, "use_grouped_mm"):
            module.use_grouped_mm = False
    generator = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, args.vocab_size, (1, SEQ_LEN), generator=generator) for _ in range(2))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False,
                                                       custom_mapping={torch.ops.aten.addmm_: _addmm_}) as counter:
        model(tokens, labels=labels, loss_chunk_tokens=8).backward()
    return counter.get_total_flops() / SEQ_LEN


@pytest.mark.parametrize("name, flavor", CASES, ids=[f"{n}-{f}" for n, f in CASES])
def test_flops_per_token_equal_torchs_count_of_a_training_step(name, flavor):
    spec = get_model_spec(name)
    args = spec.flavors[flavor]
    norms = sum(p.numel for p in spec.get("param_shapes")(args) if p.norm)
    formula = spec.get("flops_per_token")(args, SEQ_LEN) - 6 * norms
    assert counted_flops_per_token(name, flavor) == formula


def test_every_family_is_counted():
    from models.registry import list_model_names

    assert {name for name, _ in CASES} == set(list_model_names())
