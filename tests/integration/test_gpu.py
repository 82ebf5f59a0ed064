"""Tests that need a CUDA GPU: device choice, NCCL at world size 1, the MoE experts on
torch._grouped_mm, flash SDPA and the CUDA memory statistics. Skipped where CUDA is absent (CI);
on a GPU machine: ``python3 -m pytest -q tests/integration/test_gpu.py`` (about a minute on one H200).

tests/conftest.py runs these after every other test, so the forked CPU workers of the other tests
never start from a process that has initialized CUDA.
"""

from __future__ import annotations

import copy
import socket

import pytest
import torch

from tests.training_utils import REPO

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: device choice, NCCL, grouped-mm and flash kernels, CUDA memory statistics",
)

BF16_REL = 2e-2  # relative L2 error allowed of a bf16 result against fp32 (one rounding: ~2e-3)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return ((got - want).norm() / want.norm()).item()


def _clear_torchrun_env(monkeypatch) -> None:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_device_choice_binds_cuda_local_rank(monkeypatch):
    from engine.train.distributed import init_distributed, resolve_backend, resolve_device

    count, last = torch.cuda.device_count(), torch.device("cuda", torch.cuda.device_count() - 1)
    assert resolve_device("auto", 0) == torch.device("cuda", 0)
    assert resolve_device("cuda", count - 1) == last
    assert resolve_device("cpu", 0) == torch.device("cpu")  # job.device = cpu wins over a GPU
    with pytest.raises(ValueError, match="has no GPU"):
        resolve_device("auto", count)
    assert resolve_backend("auto", last) == "nccl" and resolve_backend("auto", torch.device("cpu")) == "gloo"
    _clear_torchrun_env(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", str(count - 1))  # no RANK: one process, no process group
    previous = torch.cuda.current_device()
    try:
        info = init_distributed("auto", "auto", 60)
        assert (info.device, info.backend, info.world_size) == (last, None, 1)
        assert torch.cuda.current_device() == count - 1
    finally:
        torch.cuda.set_device(previous)


def test_nccl_world_size_one_mesh_and_fsdp_bf16(monkeypatch):
    """The engine's start-up as a one-rank torchrun job: NCCL group bound to cuda:0, the 5-D mesh
    on CUDA, and an FSDP2 unit on it computing in bf16 with fp32 sharded weights and gradients."""
    import torch.distributed as dist

    from engine.train.distributed import init_distributed, shutdown_distributed
    from models.common.args import LlamaModelArgs
    from models.common.decoder import Transformer
    from parallelisms.data_parallel import apply_fsdp
    from parallelisms.parallel_dims import ParallelDims

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    _clear_torchrun_env(monkeypatch)
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
        monkeypatch.setenv(name, value)
    info = init_distributed("auto", "auto", 60)
    try:
        assert (info.device, info.backend, dist.get_backend()) == (torch.device("cuda", 0), "nccl", "nccl")
        value = torch.arange(4.0, device=info.device)
        dist.all_reduce(value)
        assert torch.equal(value.cpu(), torch.arange(4.0))
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
        dims.build_mesh("cuda")
        mesh = dims.mesh("dp_shard_cp")
        assert mesh.device_type == "cuda" and mesh.size() == 1

        args = LlamaModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=1024, max_seq_len=128)
        with torch.device("meta"):
            model = Transformer(args)
        apply_fsdp(model, mesh, param_dtype="bfloat16", reduce_dtype="float32", backend="nccl")
        model.to_empty(device=info.device)
        model.init_weights(seed=0, buffer_device=info.device)
        tokens = torch.randint(0, args.vocab_size, (2, 128), device=info.device)
        logits = model(tokens)
        assert logits.dtype == torch.bfloat16
        logits.float().logsumexp(-1).mean().backward()
        weight = model.layers["0"].feed_forward.w1.weight
        assert weight.dtype == torch.float32 and weight.grad is not None and weight.grad.dtype == torch.float32
        assert weight.device_mesh.device_type == "cuda" and torch.isfinite(weight.grad.full_tensor()).all()
    finally:
        shutdown_distributed()
    assert not dist.is_initialized()


@pytest.fixture
def grouped_mm_calls(monkeypatch):
    """The input dtypes of every torch._grouped_mm call made during the test."""
    real, calls = torch._grouped_mm, []

    def spy(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    return calls


def test_grouped_mm_experts_match_the_loop_in_bf16(grouped_mm_calls):
    """Uneven groups (one empty, none a multiple of 16 rows, so the CUDA padding is exercised):
    the grouped kernel runs and matches an fp32 per-expert loop in output and gradients; the empty
    expert gets a zero gradient."""
    from models.common.moe import GroupedExperts, _grouped_mm_usable

    counts = torch.tensor([0, 37, 129, 5, 64, 200, 1, 77], device="cuda")
    experts = GroupedExperts(512, 256, len(counts)).cuda()
    experts.init_weights(0.02, seed=0, prefix="experts")
    x32 = torch.randn(int(counts.sum()), 512, device="cuda")
    upstream = torch.randn_like(x32)

    def run(dtype, grouped):
        module = copy.deepcopy(experts).to(dtype)
        module.use_grouped_mm = grouped
        x = x32.to(dtype, copy=True).requires_grad_()
        y = module(x, counts)
        (y.float() * upstream).sum().backward()
        return [y, module.w1.grad, module.w2.grad, module.w3.grad, x.grad]

    assert _grouped_mm_usable(x32.bfloat16(), experts.w1.bfloat16())
    assert not _grouped_mm_usable(x32, experts.w1), "the CUDA kernel is bf16-only: fp32 must take the loop"
    reference = run(torch.float32, grouped=False)
    assert grouped_mm_calls == []
    grouped = run(torch.bfloat16, grouped=True)
    assert grouped_mm_calls == [torch.bfloat16] * 3
    loop = run(torch.bfloat16, grouped=False)
    for name, got, via_loop, want in zip(("out", "dw1", "dw2", "dw3", "dx"), grouped, loop, reference):
        assert rel_err(got, want) < BF16_REL, (name, rel_err(got, want))
        assert rel_err(got, via_loop) < BF16_REL, (name, rel_err(got, via_loop))
    for grad in grouped[1:4]:
        assert grad[0].abs().sum() == 0 and grad[1:].abs().sum() > 0


def test_moe_layer_under_autocast_uses_grouped_mm(grouped_mm_calls):
    """A one-process bf16 run: fp32 weights under autocast, which GroupedExperts casts for the
    grouped kernel itself; the layer's output matches its loop path."""
    from models.common.moe_args import MoEModelArgs
    from models.common.moe import MoE

    args = MoEModelArgs(dim=256, n_layers=1, n_heads=4, num_experts=8, top_k=2, moe_inter_dim=128,
                        n_shared_experts=1, score_func="sigmoid")
    layer = MoE(args).cuda()
    layer.init_weights(0.02, seed=0, prefix="moe")
    x = torch.randn(2, 256, 256, device="cuda", requires_grad=True)
    outputs = {}
    for grouped in (True, False):
        layer.experts.use_grouped_mm = grouped
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outputs[grouped] = layer(x)
    assert torch.bfloat16 in grouped_mm_calls and len(grouped_mm_calls) == 3
    assert rel_err(outputs[True], outputs[False]) < BF16_REL
    outputs[True].float().square().mean().backward()
    assert layer.experts.w1.grad is not None and layer.experts.w1.grad.dtype == torch.float32


def test_flash_sdpa_runs_the_models_attention():
    """Forced flash SDPA: the profiler sees the flash kernel, and the engine's Attention (RoPE,
    GQA repeat) in bf16 matches its fp32 math-kernel self in output and input gradient."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from models.common.args import LlamaModelArgs
    from models.common.decoder import Attention, precompute_rope

    args = LlamaModelArgs(dim=1024, n_layers=1, n_heads=8, n_kv_heads=2, max_seq_len=1024)
    attention = Attention(args).cuda()
    cos, sin = precompute_rope(args.head_dim, 1024, args.rope_theta, device="cuda")
    x32 = torch.randn(2, 1024, args.dim, device="cuda")
    upstream = torch.randn_like(x32)

    def run(module, dtype, backend):
        x = x32.to(dtype, copy=True).requires_grad_()
        with sdpa_kernel(backend):
            out = module(x, cos, sin)
            (out.float() * upstream).sum().backward()
        return out, x.grad

    want = run(attention, torch.float32, SDPBackend.MATH)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = run(copy.deepcopy(attention).bfloat16(), torch.bfloat16, SDPBackend.FLASH_ATTENTION)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention" in ops, sorted(o for o in ops if "scaled_dot" in o)
    assert rel_err(got[0], want[0]) < BF16_REL and rel_err(got[1], want[1]) < BF16_REL


def test_memory_statistics_through_the_engine():
    from engine.observe.metrics import device_memory_stats

    device = torch.device("cuda", 0)
    torch.cuda.synchronize(device)
    device_memory_stats(device, reset=True)
    base = torch.cuda.memory_allocated(device)
    assert torch.cuda.max_memory_allocated(device) == base
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    stats = torch.cuda.memory_stats(device)
    assert stats["allocated_bytes.all.peak"] >= base + block.numel() and "num_alloc_retries" in stats
    del block
    figures = device_memory_stats(device, reset=True)
    assert set(figures) == {"mem_peak_allocated_gib", "mem_peak_reserved_gib", "mem_alloc_retries"}
    assert figures["mem_peak_allocated_gib"] >= 0.25 and figures["mem_peak_reserved_gib"] >= 0.25
    assert torch.cuda.max_memory_allocated(device) == torch.cuda.memory_allocated(device) == base


def test_memory_snapshot_after_the_traced_steps(tmp_path):
    """[profiling] memory_snapshot on CUDA: the allocator history is dumped after the traced step."""
    import types

    from engine.observe.profiling import StepProfiler

    cfg = types.SimpleNamespace(enable=True, start_step=1, num_steps=1, traces_folder="traces", memory_snapshot=True)
    profiler = StepProfiler(cfg, str(tmp_path), 0, torch.device("cuda"))
    try:
        profiler.step_begin(1)
        x = torch.randn(1024, 1024, device="cuda")
        (x @ x).sum().item()
        profiler.step_end(1)
        profiler.write(1)
    finally:
        profiler.close()
    files = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert files == ["rank0_memory_step1.pickle", "rank0_step1-1.json"], files
    assert (tmp_path / "traces" / "rank0_memory_step1.pickle").stat().st_size > 0


def test_flex_document_attention_matches_dense_without_an_s_by_s_matrix():
    """Document masking on CUDA (models/common/document_mask.py): FlexAttention with a BlockMask gives the
    dense block-causal SDPA's output and input gradients (fp32), skips the 128 x 128 tiles that no
    query sees (documents of 300 tokens: over 90 % of the causal tiles), and its forward + backward
    peak stays under the bytes of one S x S bool matrix (fp32 scores of one head would be 4 x that)."""
    import torch.nn.functional as F

    from models.common.document_mask import attention_inputs, block_mask, document_attention, document_mask

    B, H, S, D = 1, 2, 8192, 64
    q, k, v = (torch.randn(B, H, S, D, device="cuda", requires_grad=True) for _ in range(3))
    docs = (torch.arange(S, device="cuda") // 300).to(torch.int32)[None]
    upstream = torch.randn(B, H, S, D, device="cuda")

    def run(fn):
        for t in (q, k, v):
            t.grad = None
        out = fn()
        (out * upstream).sum().backward()
        return out.detach(), [t.grad.clone() for t in (q, k, v)]

    pos = torch.arange(S, device="cuda")
    want, want_grads = run(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(docs, docs, pos, pos)))
    mask = block_mask(docs)
    assert mask.sparsity() > 90.0
    got, grads = run(lambda: document_attention(q, k, v, mask))  # compiles flex_attention once
    assert rel_err(got, want) < 1e-4 and all(rel_err(g, w) < 1e-4 for g, w in zip(grads, want_grads))
    del want, want_grads, got, grads
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run(lambda: document_attention(q, k, v, block_mask(docs)))
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < S * S
    # The model's blocks get the BlockMask (built outside compiled blocks), the ids under CP.
    layers = [type("Block", (), {"attention": type("Attn", (), {"attention_fn": None})()})()]
    assert not isinstance(attention_inputs(docs, layers), torch.Tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_kernels_match_sdpa(dtype):
    """Context parallel's CUDA kernels (parallelisms/ring_attention.py: the memory-efficient forward with
    log-sum-exp and its backward from the merged output) for cp 2 and 4 load-balanced ranks, driven in
    one process, equal full causal and block-causal SDPA (fp32 reference) in output and q/k/v
    gradients. In bf16 this failed with NaN dq and dk while the backward got the merged output in
    [B, H, S, D] layout, and with 'attn_bias: wrong shape' while the mask was not expanded to heads."""
    import os
    import sys

    from parallelisms.context_parallel import cp_positions

    sys.path.insert(0, os.path.join(REPO, "scripts"))
    from gpu_check_longctx import _full_reference, _simulated_ring

    b, h, s, d = 2, 4, 1024, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v, g = (torch.randn(b, h, s, d, generator=gen).to("cuda", dtype) for _ in range(4))
    documents = torch.zeros(b, s, dtype=torch.int32, device="cuda")
    documents[1, s // 5:], documents[1, s // 2 + 3:] = 1, 2
    tol = 1e-5 if dtype == torch.float32 else BF16_REL
    for cp in (2, 4):
        for docs in (None, documents):
            got = _simulated_ring(q, k, v, cp_positions(s, cp, True).to("cuda"), docs, g)
            want = _full_reference(q, k, v, docs, g)
            errors = [rel_err(x, y) for x, y in zip(got, want)]
            assert max(errors) < tol, (cp, docs is not None, errors)
