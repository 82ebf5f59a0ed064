"""GPU-check rows for long context (scripts/gpu_check.py): context parallel's ring kernels and compile with
context parallel and with the MoE family, on one GPU.

- ``ring_kernels``: the ring's per-chunk fused kernels on CUDA (``aten::_scaled_dot_product_efficient_attention``
  forward with log-sum-exp and its backward from the global output and lse, parallelisms/ring_attention.py),
  driven for cp = 2 and 4 load-balanced ranks in one process (every rank's block pairs in turn, no
  exchange), equal to full causal and block-causal SDPA in fp32 and bf16; then a block compiled with
  inductor whose attention is the ring operator on the one-rank group, against the same block eager.
- ``compile_moe``: the MoE debug model with its blocks' static parts compiled (parallelisms/compile.py),
  one forward/backward against the eager copy (loss and every gradient).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from gpu_check_common import Ctx, build_model, process_group, rel_err, step_loss, synthetic_batch

FP32_REL, BF16_REL = 1e-4, 3e-2


def _simulated_ring(q, k, v, positions, documents, dout):
    """(out, dq, dk, dv) [B, H, S, D] over the full sequence, computing every cp rank's ring with the
    ring's own pieces, kernels and merge (no communication: one process holds every block)."""
    from parallelisms.ring_attention import _kernel_backward, _kernel_forward, _lse_dtype, _merge, _pieces

    cp, scale = positions.shape[0], q.shape[-1] ** -0.5
    compute = _lse_dtype(q.dtype)
    out, dq, dk, dv = (torch.zeros(q.shape, dtype=compute, device=q.device) for _ in range(4))
    for rank in range(cp):
        mine = positions[rank]
        acc = torch.zeros(*q.shape[:2], mine.numel(), v.shape[-1], dtype=compute, device=q.device)
        lse = torch.full(acc.shape[:-1], float("-inf"), dtype=compute, device=q.device)
        pairs = [(src, _pieces(positions, rank, src, documents, q.dtype)) for src in range(cp)]
        for src, pieces in pairs:
            for qs, ks, causal, mask, has_key in pieces:
                kb, vb = k[:, :, positions[src]][:, :, ks], v[:, :, positions[src]][:, :, ks]
                o_b, l_b = _kernel_forward(q[:, :, mine][:, :, qs], kb, vb, causal, mask, scale)
                if has_key is not None:
                    l_b = l_b.masked_fill(~has_key, float("-inf"))
                acc[:, :, qs], lse[:, :, qs] = _merge(acc[:, :, qs], lse[:, :, qs], o_b.to(compute), l_b)
        final = acc.to(q.dtype)
        out[:, :, mine] = acc
        for src, pieces in pairs:
            for qs, ks, causal, mask, _ in pieces:
                src_pos = positions[src][ks]
                g = _kernel_backward(dout[:, :, mine][:, :, qs].contiguous(), q[:, :, mine][:, :, qs], k[:, :, src_pos],
                                     v[:, :, src_pos], final[:, :, qs], lse[:, :, qs], causal, mask, scale)
                rows = mine[qs]
                dq[:, :, rows] += g[0]
                dk[:, :, src_pos] += g[1]
                dv[:, :, src_pos] += g[2]
    return out, dq, dk, dv


def _full_reference(q, k, v, documents, dout):
    ref = [t.float().clone().requires_grad_() for t in (q, k, v)]
    seq = q.shape[2]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    mask = causal if documents is None else (causal & (documents[:, :, None] == documents[:, None, :])).unsqueeze(1)
    out = F.scaled_dot_product_attention(*ref, attn_mask=mask)
    out.backward(dout.float())
    return out.detach(), *(t.grad for t in ref)


def row_ring_kernels(ctx: Ctx) -> dict:
    """See the module docstring. Source: FlashAttention-2 (arXiv 2307.08691) backward from the final lse."""
    from parallelisms.context_parallel import cp_positions

    b, h, s, d = (2, 2, 32, 8) if ctx.dry else (2, 8, 2048, 64)
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(b, h, s, d, generator=gen).to(ctx.device) for _ in range(4)]
    documents = torch.zeros(b, s, dtype=torch.int32, device=ctx.device)
    documents[1, s // 5:], documents[1, s // 2 + 3:] = 1, 2
    errors = {}
    for dtype, tol in ((torch.float32, FP32_REL), (torch.bfloat16, BF16_REL)):
        q, k, v, g = (t.to(dtype) for t in base)
        for cp in (2, 4):
            for docs in (None, documents):
                got = _simulated_ring(q, k, v, cp_positions(s, cp, True).to(ctx.device), docs, g)
                want = _full_reference(q, k, v, docs, g)
                err = max(rel_err(x.float(), y) for x, y in zip(got, want))
                errors[f"{str(dtype)[6:]}_cp{cp}{'_docs' if docs is not None else ''}"] = err
                assert err < tol, f"ring kernels vs SDPA ({dtype}, cp {cp}, documents {docs is not None}): {err:.2e}"
    compiled = _compiled_ring_block(ctx)
    return {"shape": f"{b}x{h}x{s}x{d}",
            "max_rel_err_fp32": f"{max(v for n, v in errors.items() if 'float32' in n):.1e}",
            "max_rel_err_bf16": f"{max(v for n, v in errors.items() if 'bfloat16' in n):.1e}", **compiled}


def _compiled_vs_eager(eager, compiled, vocab_size: int, seq: int, device) -> tuple[float, float]:
    """One forward and backward of both copies on the same synthetic batch [2, seq]: (relative loss
    error, largest relative gradient error over the parameters that get one), asserted within fp32's
    tolerance (loss) and 1e-3 (gradients)."""
    inputs, labels = synthetic_batch(vocab_size, 2, seq, device)
    losses = []
    for model in (eager, compiled):
        loss = step_loss(model, inputs, labels)
        loss.backward()
        losses.append(loss.detach())
    loss_err = rel_err(losses[1], losses[0])
    grad_err = max(rel_err(c.grad, e.grad) for c, e in zip(compiled.parameters(), eager.parameters())
                   if e.grad is not None)
    assert loss_err < FP32_REL and grad_err < 1e-3, (losses, grad_err)
    return loss_err, grad_err


def _compiled_ring_block(ctx: Ctx) -> dict:
    """A LLaMA model whose attention is the ring operator on the one-rank group, blocks compiled
    (inductor) vs eager: loss and gradients of one step."""
    from models.common.args import LlamaModelArgs
    from parallelisms.compile import apply_compile
    from parallelisms.context_parallel import ContextParallel, apply_cp

    _, dims = process_group(ctx)
    seq = 64 if ctx.dry else 1024
    args = LlamaModelArgs(dim=128 if ctx.dry else 1024, n_layers=2, n_heads=4 if ctx.dry else 16, n_kv_heads=2,
                          vocab_size=512, max_seq_len=seq)
    context = ContextParallel(dims.mesh("cp"), seq, load_balance=True)
    eager = build_model(args, ctx.device, parallelize=lambda m: apply_cp(m, context, rotate_method="ring"))
    compiled = copy.deepcopy(eager)
    apply_compile(compiled, backend="aot_eager" if ctx.dry else "inductor")
    loss_err, grad_err = _compiled_vs_eager(eager, compiled, args.vocab_size, seq, ctx.device)
    return {"compiled_ring_loss_rel_err": f"{loss_err:.1e}", "compiled_ring_grad_rel_err": f"{grad_err:.1e}"}


def row_compile_moe(ctx: Ctx) -> dict:
    """See the module docstring. Source: torch.compile docs (fullgraph), parallelisms/compile.py."""
    from engine.setup.model_builder import materialize
    from models.moe.flavors import moe_flavors
    from models.common.moe_decoder import MoETransformer
    from parallelisms.compile import apply_compile

    seq = 64 if ctx.dry else 1024
    args = copy.deepcopy(moe_flavors["debugmodel"])
    args.max_seq_len = seq
    with torch.device("meta"):
        model = MoETransformer(args)
    eager = materialize(model, ctx.device, 0)
    compiled = copy.deepcopy(eager)
    parts = apply_compile(compiled, backend="aot_eager" if ctx.dry else "inductor")
    loss_err, grad_err = _compiled_vs_eager(eager, compiled, args.vocab_size, seq, ctx.device)
    return {"compiled_modules": parts, "loss_rel_err": f"{loss_err:.1e}", "grad_rel_err": f"{grad_err:.1e}"}
