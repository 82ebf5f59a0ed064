"""Per-rank activation bytes of a layout: what the blocks keep for backward, and the peaks beside them.

Activations (a model): the bytes saved for backward, counted per transformer block the way
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv
2205.05198, §4.1 and Table 2) count them for GPT, redone for this LLaMA block: RMSNorm inputs, the
attention inputs q, k, v (k, v repeated to every query head), the attention output and log-sum-exp
(fused attention keeps no s×s scores), and the SwiGLU tensors w1·x, silu(w1·x), w3·x and their product.
With b sequences of s tokens (s = seq_len / cp), width h, attention width d = n_heads·head_dim
(h for LLaMA; wider when head_dim is set apart from h / n_heads), SwiGLU width f, n_heads a, on
t = tp ranks:

    per block (no AC)  =  T·h·(2/t' + 2)·B + 5·T·d/t·B  +  4·T·f/t·B  +  T·a/t·4   (T = b·s tokens)
                          norm inputs, inputs of wq.. and w1.. (all-gathered under SP),
                          q, k, v (repeated), attention output and its copy for wo; SwiGLU; lse

where B = bytes per activation element (training.mixed_precision_param), t' = t with sequence
parallel (norm tensors are sequence shards) else 1. ``full`` AC keeps only each block's input
(b·s·h/t'·B) plus, during backward, one block's full set (Korthikanti eq. 6's "2sbh·L + one layer").
``selective`` keeps, per block, its input (b·s·h/t'·B, the checkpoint's) and the outputs of the
ops its per-op policy saves (parallelisms/activation_checkpoint.py): the block's matmuls in forward
order wq, wk, wv, wo, w1, w3, w2 (widths d/t, kv/t, kv/t, h, f/t, f/t, h per token, kv = n_kv_heads·
head_dim; wo and w2 give full-width partial sums under TP), the attention output and its
log-sum-exp, and under sequence parallel the two reduce-scatter outputs (h/t each):

    "op_all_matmuls"  every matmul      T·(h/t' + d/t + 2kv/t + h + 2f/t + h + d/t [+ 2h/t])·B + lse
    "op"              odd matmuls only  T·(h/t' + d/t + kv/t + f/t + h + d/t [+ 2h/t])·B + lse
                      (wq, wv, w1, w2: TorchTitan's every-second-matmul rule)

The element-wise tensors (norms, RoPE, silu, product, GQA's repeated k, v) are recomputed: in a
block's backward its recomputation brings back the rest of the no-AC set, as under full AC.
On top of the saved tensors the peak holds the larger of the loss's backward (final norm tensors and
three fp32 [T, V/t] tensors: log-softmax output, its gradient, the logits' gradient; four under loss
parallel; the fused loss: engine/planner/loss_memory.py) and one block's backward: its gradient
temporaries without AC; where the block is recomputed (full AC, every N-th block, and the per-op
policies, whose recomputation brings back what their cache does not hold) the recomputed tensors
plus the feed-forward backward's gradients, T·(2f/t + h/t')·B (three f-wide gradients and the block
output's, less the SwiGLU product checkpoint has already freed). The constants of these
last two terms are the tensors the CPU runs of tests/integration/test_planner_runs.py show alive at the peak
(torch's MemTracker).

Pipeline stages hold the activations of the microbatches in flight: M for GPipe (all forwards
first), min(M, pp - pp_rank) for 1F1B-style schedules (Narayanan et al. arXiv 2104.04473 §2.2).
The last stage also keeps each other in-flight microbatch's logits and log-probabilities (fp32 [T,
V/t]) until its backward; the first stage peaks, where its saved blocks are few (full AC), at the end
of an earlier microbatch's backward: the embedding's weight gradient beside the later microbatches'
blocks (:func:`embedding_backward_bytes`).
The family describes its blocks torch-free (models/common/planning.py): the attention's saved tensors per
token (``ModelSpec.attention_activations``, an ``AttentionActivations``: the 5d above is LLaMA's,
``gqa_attention_activations``; MLA keeps its latents on every tp rank and, on the CPU, where its
value width differs from the query-key width, SDPA's math path keeps the softmax probabilities
[H/t, s] per token instead of the output and log-sum-exp) and each block's feed-forward
(``ModelSpec.ffn_activations``: the width f, per block, and what routing keeps; else
``ModelSpec.ffn_width`` for every block; MoE: top_k routed + shared).
"""

from __future__ import annotations

from engine.planner.loss_memory import fused_loss_bytes
from models.common.planning import FeedForwardActivations, gqa_attention_activations


def _tokens(layout) -> int:
    """T: tokens of one microbatch on one rank (sequences × seq_len / cp)."""
    return layout.microbatch_size * (layout.seq_len // layout.cp)


def attention_activations(layout):
    """The family's ``models.common.planning.AttentionActivations`` for ``layout.model_args``
    (``ModelSpec.attention_activations``; LLaMA's attention when the family gives none)."""
    spec = layout.model_spec
    fn = spec.get("attention_activations") if spec.attention_activations is not None else gqa_attention_activations
    return fn(layout.model_args)


def ffn_activations(layout, layer: int | None = None) -> FeedForwardActivations:
    """The family's ``models.common.planning.FeedForwardActivations`` of block ``layer``
    (``ModelSpec.ffn_activations``; else every block ``ModelSpec.ffn_width`` wide, nothing routed);
    ``layer`` None: the block that keeps the most (4·width + routed)."""
    spec, a = layout.model_spec, layout.model_args
    if spec.ffn_activations is None:
        return FeedForwardActivations(spec.get("ffn_width")(a))
    fn = spec.get("ffn_activations")
    if layer is not None:
        return fn(a, layer)
    return max((fn(a, i) for i in range(a.n_layers)), key=lambda ffn: 4 * ffn.width + ffn.routed)


def fused_attention_kernel(layout, att) -> bool:
    """Whether SDPA runs a fused kernel (output + log-sum-exp saved) rather than its math path
    (softmax probabilities saved): torch's CPU flash kernel needs equal query/key and value widths
    (torch docs, ``torch.nn.functional.scaled_dot_product_attention``; aten sdp_utils_cpp's head-dim check)."""
    return not (layout.device_type == "cpu" and att.qk_head_dim != att.v_head_dim)


def _kernel_elements(layout, att, ac: str) -> tuple[int, int]:
    """(compute-dtype elements, fp32 elements) per token the attention kernel itself keeps under
    ``ac``: a fused kernel its output [H·v/t] and log-sum-exp [H/t] (both per-op policies save
    them); the math path its softmax probabilities [H/t, s] (without AC; "op_all_matmuls" keeps
    them and the output, the bmm outputs; "op" recomputes them)."""
    t, heads = layout.tp, att.heads // layout.tp
    if fused_attention_kernel(layout, att):
        return heads * att.v_head_dim, heads
    s = layout.seq_len // layout.cp
    if ac == "none":
        return heads * s, 0
    return (heads * s + heads * att.v_head_dim, 0) if ac == "op_all_matmuls" else (0, 0)


def matmul_output_widths(layout, layer: int | None = None) -> list[int]:
    """Per-token elements of each matmul output of block ``layer``'s forward (None: the widest
    block), in forward order: the attention's (LLaMA: wq, wk, wv, wo: d/t, kv/t, kv/t, h), then w1,
    w3, w2 (f/t, f/t, h; wo and w2 are TP's partial sums, full width)."""
    a, t = layout.model_args, layout.tp
    f = ffn_activations(layout, layer).width
    att = attention_activations(layout)
    return [w // t if split else w for w, _, split in att.matmuls] + [f // t, f // t, a.dim]


def matmul_input_widths(layout, layer: int | None = None) -> list[int]:
    """Per-token input elements of the matmuls of :func:`matmul_output_widths` (full width: FLOPs
    are output × input width per token)."""
    f = ffn_activations(layout, layer).width
    dim = layout.model_args.dim
    return [w for _, w, _ in attention_activations(layout).matmuls] + [dim, dim, f]


def block_activation_bytes(layout, ac: str, layer: int | None = None) -> int:
    """Bytes transformer block ``layer`` (None: the one that keeps the most) keeps for backward per
    microbatch (see the module docstring).

    Args:
        ac: "none", "full", "op" (every second matmul recomputed) or "op_all_matmuls".
    """
    a = layout.model_args
    T, h, t = _tokens(layout), a.dim, layout.tp
    ffn = ffn_activations(layout, layer)
    f = ffn.width  # MoE: top_k routed copies of each token + shared experts
    att = attention_activations(layout)
    bb = layout.param_bytes
    tsp = t if layout.sequence_parallel else 1
    if ac == "full":
        return T * h // tsp * bb
    kernel, lse = _kernel_elements(layout, att, ac)
    kernel_bytes = T * kernel * bb + T * lse * 4
    if ac in ("op", "op_all_matmuls"):  # the block input, the saved matmuls, attention, reduce-scatter outputs
        widths = matmul_output_widths(layout, layer)
        kept = widths[::2] if ac == "op" else widths
        scattered = 2 * h // t if layout.sequence_parallel else 0
        return T * (h // tsp + sum(kept) + scattered) * bb + kernel_bytes
    # none: two norm inputs, the (gathered) inputs of the attention's first matmuls and of w1/w3,
    # the attention's own tensors (q, k, v, the output's copy for wo, latents, QK-norm), the
    # kernel's, SwiGLU's four f-wide tensors
    attention = T * (att.split // t + att.replicated) * bb
    return T * (2 * h // tsp + 2 * h + ffn.routed) * bb + attention + kernel_bytes + 4 * T * f // t * bb


def backward_temporary_bytes(layout) -> int:
    """Gradients alive inside one block's backward: SwiGLU's four f-wide and the attention's
    (LLaMA: five d-wide tensors, d = n_heads·head_dim; the math path adds the probabilities' and
    scores' [H/t, s] gradients), in the compute dtype."""
    f = ffn_activations(layout).width
    att = attention_activations(layout)
    math = 0 if fused_attention_kernel(layout, att) else 2 * att.heads * (layout.seq_len // layout.cp)
    return _tokens(layout) * (4 * f + att.backward + math) // layout.tp * layout.param_bytes


def ring_inflight_bytes(layout) -> int:
    """Bytes context parallel's ring (parallelisms/ring_attention.py, ``cp_rotate_method = "ring"``,
    cp > 1) holds beyond the block's saved tensors at the peak of one block's backward, at a hop of the
    ring: the fp32 accumulators of dq and of the travelling block's dk, dv, the received block's dk,
    dv (fp32) and k, v, this rank's k, v and the output gradient made contiguous for the kernels
    (compute dtype): T·(d/t)·(5·4 + 5·B), d = n_heads·head_dim (K/V repeated to every query head).
    The kernels themselves keep only [H/t] per token (lse) between the chunks; 0 without the ring."""
    if layout.cp == 1 or layout.cfg.parallelism.cp_rotate_method != "ring":
        return 0
    att = attention_activations(layout)
    d = att.heads * att.v_head_dim
    return _tokens(layout) * d // layout.tp * (5 * 4 + 5 * layout.param_bytes)


def recomputed_backward_bytes(layout) -> int:
    """Bytes beyond the recomputed block's activations at its backward's peak, when the whole block
    is recomputed (full AC, selective every N-th block) or its per-op policy's recomputation has
    brought back what the cache does not hold: in the feed-forward's backward, the gradients
    of w1·x, w3·x and silu(w1·x) (three [T, f/t]) and of the block's output ([T, h/t']), less the
    SwiGLU product (f/t), which checkpoint frees once w2's backward has used it:
    T·(2f/t + h/t')·B. The attention's temporaries come later, when the feed-forward's tensors are
    gone. This is what torch's MemTracker shows alive at that peak in the CPU run of
    tests/integration/test_planner_runs.py (single_ac_full, single_s256_ac_full, single_s256_ac_op); without
    recomputation the block's backward keeps :func:`backward_temporary_bytes`."""
    a = layout.model_args
    f = ffn_activations(layout).width
    tsp = layout.tp if layout.sequence_parallel else 1
    return _tokens(layout) * (2 * f // layout.tp + a.dim // tsp) * layout.param_bytes


def head_peak_bytes(layout) -> int:
    """The last stage's peak at the loss: the final norm's input and (gathered) output, and
    cross entropy's fp32 [T, V/t] tensors alive in its backward: the log-softmax output, its gradient
    and the logits' gradient (one more under loss parallel, whose log-softmax keeps its exp); under
    pipeline parallel also the output weight's gradient of a later microbatch before it is added to
    the accumulated one. The fused loss (``loss.chunk_tokens`` > 0): engine/planner/loss_memory.py."""
    if layout.cfg.loss.chunk_tokens > 0:
        return fused_loss_bytes(layout, _tokens(layout))
    a = layout.model_args
    T, t = _tokens(layout), layout.tp
    tsp = t if layout.sequence_parallel else 1
    copies = 4 if t > 1 and layout.cfg.parallelism.loss_parallel else 3
    head = T * (a.dim // tsp + a.dim) * layout.param_bytes + copies * T * (a.vocab_size // t) * 4
    if layout.pp > 1:  # a later microbatch's output-weight gradient [V/t, h], before it is accumulated
        head += a.vocab_size // t * a.dim * 4
    return head


def ac_kind(layout) -> str:
    """The AC setting as the formulas name it: "none", "full", "op", "op_all_matmuls" or "every"
    (selective every N-th block)."""
    mode, option = layout.ac
    if mode in ("none", "full"):
        return mode
    return option if option in ("op", "op_all_matmuls") else "every"


def saved_per_microbatch(layout, pp_rank: int = 0) -> int:
    """Bytes the blocks of pp rank ``pp_rank`` (all its stages) keep for backward per microbatch."""
    ac = ac_kind(layout)
    layers = [i for stage_layers, _, _ in layout.stages_of(pp_rank)
              for i in (stage_layers if stage_layers is not None else range(layout.model_args.n_layers))]
    if ac == "every":  # selective N: every N-th block fully recomputed
        full = len(layers) // int(layout.ac[1])
        return full * block_activation_bytes(layout, "full") + sum(
            block_activation_bytes(layout, "none", i) for i in layers[full:])
    return sum(block_activation_bytes(layout, ac, i) for i in layers)


def prediction_depth_bytes(layout) -> int:
    """Bytes the last stage's further prediction depths (``ModelSpec.prediction_blocks``: DeepSeek-V3's
    multi-token prediction, models/deepseek_v3/mtp.py) keep per microbatch, each: its block without
    AC (it is outside the checkpointed ``layers``), its input, 8·[T, h] (the shifted tokens'
    embedding, two RMSNorms' input, normalized tensor and output less the shared one, their
    concatenation of 2h), and its loss's tensors kept from the forward: with the fused loss its norm
    (2·[T, h]), G_h [T, h] and G_W [V/t, h] fp32 (engine/planner/loss_memory.py), else its norm and
    the log-probabilities, fp32 [T, V/t] (log-softmax's backward needs only its output)."""
    spec = layout.model_spec
    if spec.prediction_blocks is None:
        return 0
    a, T, bb = layout.model_args, _tokens(layout), layout.param_bytes
    if layout.cfg.loss.chunk_tokens > 0:
        loss = T * 3 * a.dim * bb + a.vocab_size // layout.tp * a.dim * 4
    else:
        loss = T * 2 * a.dim * bb + T * (a.vocab_size // layout.tp) * 4
    return sum(block_activation_bytes(layout, "none", layer) + T * 8 * a.dim * bb + loss
               for layer in spec.get("prediction_blocks")(a))


def microbatches_in_flight(layout, pp_rank: int = 0) -> int:
    """Microbatches whose activations pp rank ``pp_rank`` holds at once: 1 without PP, M under GPipe
    (all forwards first), min(M, pp - pp_rank) under 1F1B-style schedules, times the local stages."""
    if layout.pp == 1:
        return 1
    m = layout.pp_microbatches
    in_flight = m if layout.cfg.parallelism.pp_schedule.lower() == "gpipe" else min(m, layout.pp - pp_rank)
    return in_flight * len(layout.stages_of(pp_rank))


def activation_bytes(layout, pp_rank: int = 0) -> int:
    """Peak activation bytes of one rank (module docstring): the saved tensors of every block of the
    microbatches in flight, plus the larger of the loss's peak (last stage) and one block's backward
    (its recomputation first, under AC)."""
    ac = ac_kind(layout)
    stages = layout.stages_of(pp_rank)
    n_layers = sum(len(layers) if layers is not None else layout.model_args.n_layers for layers, _, _ in stages)
    has_last = any(last for _, _, last in stages)
    per_mb = saved_per_microbatch(layout, pp_rank)
    in_flight = microbatches_in_flight(layout, pp_rank)
    backward = backward_temporary_bytes(layout)
    if ac in ("full", "every"):
        backward = block_activation_bytes(layout, "none") + recomputed_backward_bytes(layout)
    elif ac != "none":  # per-op: the recomputation brings back what the cache does not hold
        backward = block_activation_bytes(layout, "none") - block_activation_bytes(layout, ac) \
            + block_activation_bytes(layout, "full") + recomputed_backward_bytes(layout)
    backward += ring_inflight_bytes(layout)
    head = 0
    if has_last:
        # Each other microbatch in flight on the last stage (GPipe: all M) still holds its
        # log-probabilities and the stage's output logits, fp32 [T, V/t] each, until its backward.
        a = layout.model_args
        head = head_peak_bytes(layout)
        if layout.cfg.loss.chunk_tokens <= 0:  # the fused loss keeps no [T, V] tensor (loss_memory.py)
            head += (in_flight // len(stages) - 1) * 2 * _tokens(layout) * (a.vocab_size // layout.tp) * 4
    if has_last:
        per_mb += prediction_depth_bytes(layout)
    peak = per_mb * in_flight + max(head, backward) + document_mask_bytes(layout, n_layers, in_flight)
    if any(first for _, first, _ in stages) and layout.pp_microbatches > 1:
        # the first microbatch's backward ends at the embedding: the later ones' blocks stay saved
        peak = max(peak, per_mb * (in_flight - 1) + embedding_backward_bytes(layout))
    return peak


def embedding_backward_bytes(layout) -> int:
    """The first stage's peak at the end of an earlier microbatch's backward, beyond the later
    microbatches' saved blocks: the embedding's weight gradient [V/t, h] (fp32 master weights, the
    compute dtype under FSDP) before it is added to the accumulated one, and six [T, h/t'] tensors
    in the compute dtype (the embedding output's gradient, the stage's output and input gradient
    buffers of the pipeline; the constant is what the CPU runs of tests/integration/test_planner_runs.py show
    alive there, MemTracker)."""
    a = layout.model_args
    tsp = layout.tp if layout.sequence_parallel else 1
    grad_bytes = layout.param_bytes if layout.fsdp > 1 else 4
    return a.vocab_size // layout.tp * a.dim * grad_bytes + 6 * _tokens(layout) * a.dim // tsp * layout.param_bytes


FLEX_BLOCK = 128  # FlexAttention's default sparse block (tokens per side)


def document_mask_bytes(layout, n_layers: int, in_flight: int) -> int:
    """Bytes ``[document_mask]`` adds to a rank's peak (models/common/document_mask.py), with b sequences of
    S tokens per microbatch, s = S / cp local tokens, ``n_layers`` blocks on the rank and
    ``in_flight`` microbatches alive:

    - kept per microbatch: the int32 document ids of whole windows (4·b·S); with restart_positions
      the int64 positions (8·b·s) and per-sequence fp32 cos/sin tables (2·4·b·s·head_dim/2);
    - the mask, with ``enable``: under context parallel one block pair's bool mask at a time
      (b·s², rebuilt in backward, never saved); else on CUDA the FlexAttention ``BlockMask``
      (int32 indices of partial and full blocks, by rows and by columns: 4·4·b·n², n = ⌈S/128⌉,
      shared by the layers); on the CPU the dense mask SDPA saves per layer, as a float additive
      mask in the compute dtype (n_layers·B·b·S², B bytes per element) plus the bool one being built.
    """
    dm = layout.cfg.document_mask
    if not (dm.enable or dm.restart_positions):
        return 0
    b, S, cp = layout.microbatch_size, layout.seq_len, layout.cp
    s = S // cp
    kept = 4 * b * S
    if dm.restart_positions:
        kept += 8 * b * s + 2 * 4 * b * s * (layout.model_args.head_dim // 2)
    transient = 0
    if dm.enable and cp > 1:
        transient = b * s * s
    elif dm.enable and layout.device_type == "cuda":
        n = -(-S // FLEX_BLOCK)
        kept += 4 * 4 * b * n * n + 4 * 4 * b * n
    elif dm.enable:
        kept += n_layers * layout.param_bytes * b * S * S
        transient = b * S * S
    return kept * in_flight + transient
