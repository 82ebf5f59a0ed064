"""Re-assemble one step's records of a parallel layout (engine/observe/record.py) into the view one
process has of the same step, so that every module's input and output and every gradient can be
compared with the one-process run tensor by tensor.

Activations are ``[batch, seq, *features]`` in every Quadra model, or the same tokens flattened
(``[batch · seq, *features]``: a router's input). For each module the per-rank calls are put back
together in this order:

1. tensor parallel: the tp ranks' copies of a call are joined along the dim a DTensor names
   (``Shard(d)``), summed when partial, else by shape against the one-process features: a feature
   dim ``tp`` times smaller is a column-parallel shard, a sequence ``tp`` times shorter a
   sequence-parallel shard (Korthikanti et al. 2022, arXiv 2205.05198), an equal shape a replica;
2. the calls (accumulation microbatches, pipeline microbatches) are concatenated along the batch;
3. context parallel: each cp rank's tokens go back to their global positions (the load-balanced
   order of parallelisms/context_parallel.py is undone with the positions each rank recorded);
4. data parallel: the dp ranks' samples are concatenated and put in the one-process order by
   matching the samples' tokens (every rank records the [batch, seq] inputs of its microbatches);
5. pipeline parallel: a module lives on one stage; names are the model's own FQNs on every stage.

Rows grouped by expert (a module given ``(rows, counts)``, models/common/moe.py ``GroupedExperts``)
have a layout-dependent order (each dp rank sorts its own tokens; expert parallel moves them); they
are compared as per-expert row sums ``[num_experts, *features]`` (float64), which no order changes.
Everything is assembled in float64. Gradients are whole already (``full_tensor`` on the ranks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch


@dataclass
class View:
    """One run's step as one process sees it.

    Attributes:
        outputs, inputs: ``{module: tensor}``: ``[B, S, *features]`` float64 (B samples of the step
            in the reference's order, S = seq_len), or ``[num_experts, *features]`` per-expert sums
            for grouped rows (names in ``grouped``);
        order: module names in forward order; grads: ``{param: float64 tensor}``; grad_order:
            parameter names in backward order (empty when the run could not record it);
        skipped: ``{"module (out|in)": reason}`` for what could not be re-assembled;
        samples: LongTensor [B, S], the step's samples in this view's row order.
    """

    outputs: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)
    grouped: set = field(default_factory=set)
    order: list = field(default_factory=list)
    grads: dict = field(default_factory=dict)
    grad_order: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)
    samples: torch.Tensor | None = None


class AssemblyError(ValueError):
    """The records cannot be put together (missing ranks, other steps, other samples)."""


def load_records(folder: str) -> list[dict]:
    """Every ``rank-<r>.pt`` of a record folder, by rank.

    Raises:
        AssemblyError: no records, or records of different steps.
    """
    names = sorted((n for n in os.listdir(folder) if n.startswith("rank-") and n.endswith(".pt")),
                   key=lambda n: int(n[5:-3])) if os.path.isdir(folder) else []
    if not names:
        raise AssemblyError(f"no rank-<r>.pt records in {folder} (did the run reach record.step?)")
    records = [torch.load(os.path.join(folder, n), map_location="cpu", weights_only=False) for n in names]
    if len({r["step"] for r in records}) != 1:
        raise AssemblyError(f"{folder}: records of different steps {sorted({r['step'] for r in records})}")
    return records


def _key(record: dict, *dims: str) -> tuple:
    return tuple(record["coords"][d] for d in dims)


def _to_tokens(t: torch.Tensor, batch: int) -> torch.Tensor | None:
    """``t`` as [batch, s, *features]: as it is when its first dim is the batch, else its flattened
    tokens split into ``batch`` sequences; None when neither fits."""
    if t.dim() >= 2 and t.shape[0] == batch:
        return t
    if t.dim() >= 1 and batch and t.shape[0] % batch == 0 and t.shape[0] > batch:
        return t.reshape(batch, t.shape[0] // batch, *t.shape[1:])
    return None


def _expert_sums(t: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[E, *features] float64: the sum of each expert's rows of ``t`` [N, *features] (``counts`` [E])."""
    expert = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    return torch.zeros(counts.numel(), *t.shape[1:], dtype=torch.float64).index_add_(0, expert, t.double())


def _join_tp(calls: list[dict], features, batch: int, seq: int, grouped: bool) -> torch.Tensor | str:
    """One call's copies on the tp ranks (tp order) -> the call as one tp rank-group sees it:
    [batch, seq, *features] (or per-expert sums when ``grouped``); a string says why it cannot."""
    tp = len(calls)
    tensors = [c["t"].double() for c in calls]
    if calls[0]["partial"]:
        joined = [sum(tensors)]
    elif calls[0]["shard"] is not None:
        joined = [torch.cat(tensors, dim=calls[0]["shard"])]
    else:
        joined = tensors
    if grouped:
        if tuple(joined[0].shape[1:]) == tuple(features):
            return _expert_sums(joined[0], calls[0]["counts"])
        return f"grouped rows of features {tuple(joined[0].shape[1:])}, one process {tuple(features)}"
    shaped = [_to_tokens(t, batch) for t in joined]
    if any(t is None for t in shaped):
        return f"shape {tuple(joined[0].shape)} is not [batch {batch}, seq, ...] nor its flattened tokens"
    s, f = shaped[0].shape[1], tuple(shaped[0].shape[2:])
    if f == tuple(features) and s == seq:
        return shaped[0]
    if len(shaped) == tp and tp > 1:
        if f == tuple(features) and s * tp == seq:
            return torch.cat(shaped, dim=1)  # sequence parallel
        differ = [j for j, (a, b) in enumerate(zip(f, features)) if a != b]
        if s == seq and len(f) == len(features) and len(differ) == 1 and f[differ[0]] * tp == features[differ[0]]:
            return torch.cat(shaped, dim=2 + differ[0])  # column-parallel features
    return (f"shape {tuple(joined[0].shape)} fits neither a replica nor a tp shard of "
            f"[{batch}, {seq}, *{tuple(features)}]")


def assemble(records: list[dict], reference: View | None = None) -> View:
    """The one-process :class:`View` of a layout's records (module docstring).

    Args:
        records: :func:`load_records` of one run; reference: the one-process run's view (its
            feature shapes and sample order); None when ``records`` are the one-process run's.

    Raises:
        AssemblyError: the layout's step trained other samples than the reference's.
    """
    view = View()
    first = records[0]
    seq = first["inputs"][0].shape[1]
    by_group: dict[tuple, list[dict]] = {}
    for r in records:
        by_group.setdefault(_key(r, "pp", "dp", "cp"), []).append(r)
    for group in by_group.values():
        group.sort(key=lambda r: r["coords"]["tp"])
    # The samples of every dp rank (any rank of it holds them whole), dp order, then the reference's order.
    dp_inputs = {}
    for r in records:
        dp_inputs.setdefault(r["coords"]["dp"], torch.cat(r["inputs"]))
    samples = torch.cat([dp_inputs[d] for d in sorted(dp_inputs)])
    perm = None if reference is None else _match_samples(samples, reference.samples)
    view.samples = samples if perm is None else samples[perm]
    ref_order = reference.order if reference is not None else []
    names = list(dict.fromkeys(ref_order + [n for r in records for n in r["order"]]))
    view.order = names
    for name in names:
        for side, out in (("out", view.outputs), ("in", view.inputs)):
            got = _assemble_module(name, side, by_group, seq, reference)
            if isinstance(got, str):
                view.skipped[f"{name} ({side})"] = got
                continue
            if got is None:
                continue
            tensor, grouped = got
            if grouped:
                view.grouped.add(name)
            elif perm is not None:
                tensor = tensor[perm]
            out[name] = tensor
    for r in records:
        view.grads.update({k: v.double() for k, v in r["grads"].items()})
        if r["grad_order"] and not view.grad_order:
            view.grad_order = list(r["grad_order"])
    return view


def _assemble_module(name, side, by_group, seq, reference):
    """(tensor, grouped) of one module side over all groups, None when no rank recorded it, or the
    reason it cannot be assembled."""
    ref_side = None if reference is None else (reference.outputs if side == "out" else reference.inputs)
    per_dp: dict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
    grouped_sum, grouped = None, None
    for (pp, dp, cp), group in sorted(by_group.items()):
        entries = [r["modules"].get(name, {}).get(side, []) for r in group]
        if not entries[0]:
            continue
        if any(len(e) != len(entries[0]) for e in entries):
            return f"tp ranks recorded {[len(e) for e in entries]} calls"
        batch_rank = sum(int(x.shape[0]) for x in group[0]["inputs"])
        calls = len(entries[0])
        if batch_rank % calls:
            return f"{calls} calls do not split the rank's {batch_rank} samples evenly"
        batch, cp_size = batch_rank // calls, group[0]["coords"]["cp_size"]
        is_grouped = entries[0][0]["counts"] is not None
        if ref_side is not None and name in ref_side:
            ref_t = ref_side[name]
            features = tuple(ref_t.shape[1:]) if is_grouped else tuple(ref_t.shape[2:])
        elif reference is None:  # the one-process run: its own shapes are the features
            t0 = entries[0][0]["t"]
            tokens = None if is_grouped else _to_tokens(t0, batch)
            if not is_grouped and tokens is None:
                return f"shape {tuple(t0.shape)} is not [batch {batch}, seq, ...] nor its flattened tokens"
            features = tuple(t0.shape[1:]) if is_grouped else tuple(tokens.shape[2:])
        else:
            return "the one-process run has no such tensor to compare"
        joined = []
        for i in range(calls):
            part = _join_tp([e[i] for e in entries], features, batch, seq // cp_size, is_grouped)
            if isinstance(part, str):
                return part
            joined.append(part)
        grouped = is_grouped
        if is_grouped:
            total = sum(joined)
            grouped_sum = total if grouped_sum is None else grouped_sum + total
        else:
            positions = group[0]["positions"]
            per_dp.setdefault(dp, []).append((torch.cat(joined), positions))
    if grouped:
        return grouped_sum, True
    if not per_dp:
        return None
    parts = []
    for dp in sorted(per_dp):
        pieces = per_dp[dp]
        if len(pieces) == 1 and pieces[0][1] is None:
            parts.append(pieces[0][0])
            continue
        local = pieces[0][0]
        full = local.new_zeros(local.shape[0], seq, *local.shape[2:])
        for tensor, positions in pieces:
            full[:, positions] = tensor
        parts.append(full)
    return torch.cat(parts), False


def _match_samples(samples: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """LongTensor [B]: ``perm`` with ``samples[perm] == reference`` row by row.

    Raises:
        AssemblyError: a reference sample the layout did not train at this step.
    """
    if samples.shape != reference.shape:
        raise AssemblyError(f"the layout trained {tuple(samples.shape)} tokens at this step, one process "
                            f"{tuple(reference.shape)}: the data differ, not the arithmetic")
    free: dict[bytes, list[int]] = {}
    for i, row in enumerate(samples):
        free.setdefault(row.numpy().tobytes(), []).append(i)
    perm = []
    for j, row in enumerate(reference):
        rows = free.get(row.numpy().tobytes())
        if not rows:
            raise AssemblyError(f"one process's sample {j} of this step is not among the layout's: the data "
                                "differ, not the arithmetic")
        perm.append(rows.pop(0))
    return torch.tensor(perm)
