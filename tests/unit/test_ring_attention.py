"""Context-parallel attention equals full causal attention, forward and backward (gloo, CPU)."""

from __future__ import annotations

import pytest
import torch

from parallelisms.context_parallel import ContextParallelError, cp_positions, validate_context_parallel
from engine.testing.processes import run_distributed


def test_head_tail_positions():
    assert cp_positions(8, 2, load_balance=True).tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert cp_positions(8, 2, load_balance=False).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ContextParallelError, match="training.seq_len = 6 must be divisible by 2·cp = 4"):
        cp_positions(6, 2, load_balance=True)


@pytest.mark.parametrize(
    "args, message",
    [
        ((64, 2, 2, True, "ring"), None),
        ((60, 2, 2, True, "ring"), "divisible by 2·cp·tp = 8"),
        ((62, 2, 2, False, "ring"), "divisible by cp·tp = 4"),
        ((64, 2, 1, True, "alltoall"), "cp_rotate_method = 'alltoall'"),
    ],
)
def test_validation(args, message):
    if message is None:
        validate_context_parallel(*args)
    else:
        with pytest.raises(ContextParallelError, match=message):
            validate_context_parallel(*args)


def _documents(batch: int, seq_len: int) -> torch.Tensor:
    """int [B, S] document ids: sequence 0 one document, sequence 1 documents starting at 0, 5 and 11."""
    ids = torch.zeros(batch, seq_len, dtype=torch.int32)
    ids[1, 5:], ids[1, 11:] = 1, 2
    return ids


def _compare(method: str, load_balance: bool, dtype_name: str, with_documents: bool = False,
             compiled: bool = False) -> tuple[float, float]:
    import torch.distributed as dist

    from parallelisms.ring_attention import allgather_attention, ring_attention

    dist.init_process_group("gloo")
    dtype = getattr(torch, dtype_name)
    cp, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, 16, 8, generator=gen, dtype=dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    documents = _documents(2, 16) if with_documents else None
    if documents is None:
        full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        causal = torch.ones(16, 16, dtype=torch.bool).tril()
        mask = (causal & (documents[:, :, None] == documents[:, None, :])).unsqueeze(1)
        full = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    full.backward(dout)
    positions = cp_positions(16, cp, load_balance)
    mine = positions[rank]
    local = [t.detach()[:, :, mine].clone().requires_grad_(True) for t in (q, k, v)]
    fn = ring_attention if method == "ring" else allgather_attention
    if compiled:  # as a compiled block calls it: the group by name, this rank as an int
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
        out = fn(*local, positions, dist.group.WORLD.group_name, documents, rank=rank)
    else:
        out = fn(*local, positions, dist.group.WORLD, documents)
    out.backward(dout[:, :, mine])
    fwd_err = (out - full.detach()[:, :, mine]).abs().max().item()
    bwd_err = max((l.grad - t.grad[:, :, mine]).abs().max().item() for l, t in zip(local, (q, k, v)))
    return fwd_err, bwd_err


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_matches_full_attention_fp64(cp, load_balance, method):
    for fwd_err, bwd_err in run_distributed(_compare, cp, method, load_balance, "float64"):
        assert fwd_err < 1e-10 and bwd_err < 1e-10, (fwd_err, bwd_err)


@pytest.mark.parametrize("cp, load_balance", [(2, True), (4, False)])
def test_matches_block_causal_attention_fp64(cp, load_balance):
    """Document masks: the per-block additive mask, and query rows with no visible key in a block
    (sequence 1's documents 1 and 2 see none of the keys before position 5, resp. 11)."""
    for fwd_err, bwd_err in run_distributed(_compare, cp, "ring", load_balance, "float64", True):
        assert fwd_err < 1e-10 and bwd_err < 1e-10, (fwd_err, bwd_err)


@pytest.mark.parametrize("method, load_balance, with_documents", [("ring", True, True), ("allgather", False, False)])
def test_compiled_matches_full_attention_fp64(method, load_balance, with_documents):
    """Inside a ``fullgraph`` compile (Dynamo + AOTAutograd): the ring's operator as an opaque node, the
    all-gather's functional collectives traced into the forward and backward graphs."""
    for fwd_err, bwd_err in run_distributed(_compare, 2, method, load_balance, "float64", with_documents, True):
        assert fwd_err < 1e-10 and bwd_err < 1e-10, (fwd_err, bwd_err)


def test_matches_full_attention_fp32():
    for fwd_err, bwd_err in run_distributed(_compare, 2, "ring", True, "float32"):
        assert fwd_err < 1e-5 and bwd_err < 1e-5, (fwd_err, bwd_err)


# opcheck's checks but "test_aot_dispatch_dynamic" (a compile of each operator: 20 s on 2 cores; the
# compiled parity layouts, ``<layout>_compiled`` in tests/integration/test_context_parallel.py, trace the operators as compiled blocks do)
CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _opcheck() -> None:
    import torch.distributed as dist

    from parallelisms.ring_attention import _ring_backward, _ring_forward

    dist.init_process_group("gloo")
    name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(0)
    # q/k/v as the model hands them over: [B, S, H, D] transposed to [B, H, S, D] (non-contiguous)
    q, k, v, g = (torch.randn(2, 16, 3, 8, generator=gen).transpose(1, 2) for _ in range(4))
    positions = cp_positions(16, 1, False)
    torch.library.opcheck(_ring_forward, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), positions,
                                          None, name), test_utils=CHECKS)
    out, lse = _ring_forward(q.detach(), k.detach(), v.detach(), positions, None, name)
    torch.library.opcheck(_ring_backward, (g, q.detach(), k.detach(), v.detach(), out, lse, positions, None, name),
                          test_utils=CHECKS)


def test_ring_operator_fake_kernels_and_autograd():
    """torch.library.opcheck: the operators' fake kernels give the real outputs' shapes and strides
    (inductor asserts them), schema and autograd registration are consistent (one rank)."""
    run_distributed(_opcheck, 1)


def _compare_narrow_values() -> tuple[float, float]:
    """MLA's shapes (models/deepseek_v3): value heads of 12 beside query-key heads of 24, cp 2."""
    import torch.distributed as dist

    from parallelisms.ring_attention import ring_attention

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 16, 24, generator=gen, dtype=torch.float64) for _ in range(2))
    v, dout = (torch.randn(2, 3, 16, 12, generator=gen, dtype=torch.float64) for _ in range(2))
    for t in (q, k, v):
        t.requires_grad_(True)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    full.backward(dout)
    positions = cp_positions(16, 2, True)
    mine = positions[rank]
    local = [t.detach()[:, :, mine].clone().requires_grad_(True) for t in (q, k, v)]
    out = ring_attention(*local, positions, dist.group.WORLD)
    out.backward(dout[:, :, mine])
    bwd = max((l.grad - t.grad[:, :, mine]).abs().max().item() for l, t in zip(local, (q, k, v)))
    return (out - full.detach()[:, :, mine]).abs().max().item(), bwd


def test_narrower_value_heads_match_full_attention():
    for fwd_err, bwd_err in run_distributed(_compare_narrow_values, 2):
        assert fwd_err < 1e-10 and bwd_err < 1e-10, (fwd_err, bwd_err)


class _RecordingEfficientKernels:
    """Stands in for ``torch.ops.aten`` in parallelisms/ring_attention.py: records what the CUDA
    branch hands the memory-efficient kernels and returns meta tensors of their outputs' shapes."""

    def __init__(self):
        self.calls = []

    def _scaled_dot_product_efficient_attention(self, q, k, v, bias, compute_lse, dropout, causal, scale=None):
        self.calls.append(("forward", bias, None))
        lse_rows = -(-q.shape[2] // 32) * 32
        return (q.new_empty(q.shape[:3] + v.shape[-1:]), q.new_empty(q.shape[:2] + (lse_rows,), dtype=torch.float32),
                None, None)

    def _scaled_dot_product_efficient_attention_backward(self, dout, q, k, v, bias, out, lse, *rest, scale=None):
        self.calls.append(("backward", bias, out))
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


@pytest.mark.parametrize("width", [24, 32])
def test_cuda_kernel_arguments(monkeypatch, width):
    """What the CUDA kernels need, measured on an H200 (torch 2.11), checked here on meta tensors:
    the additive mask expanded to [B, H, Lq, Lk] over a row stride that is a multiple of 16 (else
    'attn_bias: wrong shape (head dimension)'), and the output handed to the backward in the layout
    the forward returns ([B, Lq, H, Dv] in memory; else bf16 dq and dk 45 % off, NaN or an illegal
    memory access). Values: the mask's entries are unchanged (checked on CPU tensors)."""
    import parallelisms.ring_attention as ring

    kernels = _RecordingEfficientKernels()
    monkeypatch.setattr(ring, "aten", kernels)
    b, h, lq, d = 2, 4, 16, 8
    q, dout = (torch.empty(b, h, lq, d, device="meta") for _ in range(2))
    k, v = (torch.empty(b, h, width, d, device="meta") for _ in range(2))
    mask = torch.empty(b, 1, lq, width, device="meta")
    out, lse = ring._kernel_forward(q, k, v, False, mask, 0.125)
    merged = torch.empty(b, h, lq, d, device="meta")  # the ring's merged output: [B, H, Lq, Dv]-contiguous
    ring._kernel_backward(dout, q, k, v, merged, lse, False, mask, 0.125)
    (_, fwd_bias, _), (_, bwd_bias, bwd_out) = kernels.calls
    for bias in (fwd_bias, bwd_bias):
        assert bias.shape == (b, h, lq, width) and bias.stride(-1) == 1 and bias.stride(-2) % 16 == 0, bias.stride()
    assert bwd_out.shape == merged.shape and bwd_out.transpose(1, 2).is_contiguous(), bwd_out.stride()
    assert out.shape == (b, h, lq, d) and lse.shape == (b, h, lq)
    values = torch.randn(b, 1, lq, width)
    assert torch.equal(ring._cuda_bias(values, q, k), values.expand(b, h, lq, width))
