"""Parallel layouts for parity runs: a short name per layout, parsed to config overrides, and the
automatic list of every layout that fits a process budget (torch-free).

A layout name is parts joined by ``x``; each part is a parallelism and its degree:

============  ==========================================================================
``ddpN``      ``dp_replicate = N`` (DDP; with ``fsdpM`` it is HSDP)
``fsdpN``     ``dp_shard = N`` (FSDP2)
``hsdpN``     HSDP over N ranks: ``dp_replicate = 2``, ``dp_shard = N / 2``
``tpN``       ``tp = N`` with sequence parallel; ``tpN:nosp`` without it
``ppN:S``     ``pp = N`` with schedule S (a ``torch.distributed.pipelining`` name; default the config's)
``cpN``       ``cp = N``; ``cpN:allgather`` gathers K/V instead of the ring
``epN``       ``ep = N`` (MoE); without ``fsdp``/``cp`` parts it sets ``dp_shard = N`` to carve it from
``accumN``    N microbatches per rank per step: ``local_batch_size = global / (dp · N)``
============  ==========================================================================

e.g. ``fsdp2``, ``tp2xpp2:1F1B``, ``fsdp2xcp2xtp2``. The reference ``1`` is one process. The world
size of a layout is pp × dp_replicate × dp_shard × cp × tp (ep is carved out of dp_shard × cp, as in
parallelisms/parallel_dims.py). Whether a layout is legal is decided by the launcher's own
pre-flight (engine/setup/preflight.py), never by rules copied here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from parallelisms.pipeline_plan import KNOWN_SCHEDULES

REFERENCE = "1"
_PART = re.compile(r"^(ddp|fsdp|hsdp|tp|pp|cp|ep|accum)(\d+)(?::(\w+))?$")
DEGREE_KEYS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


class LayoutError(ValueError):
    """A layout name that cannot be parsed; the message names it and the grammar."""


@dataclass
class ParityLayout:
    """One parity layout.

    Attributes:
        name: its short name (module docstring); ``world_size``: processes it needs;
        overrides: ``{"section.key": value}`` the layout sets on top of the config;
        accum: microbatches per rank requested with ``accumN`` (0: the config's own).
    """

    name: str
    world_size: int
    overrides: dict = field(default_factory=dict)
    accum: int = 0


def parse_layout(name: str) -> ParityLayout:
    """The :class:`ParityLayout` of a name such as ``"fsdp2xtp2"`` or ``"pp2:Interleaved1F1B"``.

    Raises:
        LayoutError: an unknown part, a degree below 1, a part given twice, an unknown schedule.
    """
    name = name.strip()
    degrees = dict.fromkeys(DEGREE_KEYS, 1)
    extra: dict = {}
    accum, seen = 0, set()
    if name == REFERENCE:
        return ParityLayout(REFERENCE, 1, {f"parallelism.{k}": 1 for k in DEGREE_KEYS})
    for part in name.split("x"):
        match = _PART.match(part)
        if not match:
            raise LayoutError(f"layout {name!r}: part {part!r} is not one of ddpN, fsdpN, hsdpN, tpN[:nosp], "
                              f"ppN[:schedule], cpN[:allgather], epN, accumN (joined by 'x', e.g. fsdp2xtp2)")
        kind, degree, option = match.group(1), int(match.group(2)), match.group(3)
        if degree < 1 or kind in seen:
            raise LayoutError(f"layout {name!r}: {part!r} " + ("needs a degree of at least 1" if degree < 1
                                                              else f"repeats {kind}"))
        seen.add(kind)
        _apply_part(name, kind, degree, option, degrees, extra)
        if kind == "accum":
            accum = degree
    if "ep" in seen and not seen & {"fsdp", "hsdp", "cp"}:
        degrees["dp_shard"] = degrees["ep"]
    world = degrees["pp"] * degrees["dp_replicate"] * degrees["dp_shard"] * degrees["cp"] * degrees["tp"]
    overrides = {f"parallelism.{k}": v for k, v in degrees.items()}
    overrides.update(extra)
    return ParityLayout(name, world, overrides, accum)


def _apply_part(name: str, kind: str, degree: int, option: str | None, degrees: dict, extra: dict) -> None:
    options = {"tp": ("nosp",), "cp": ("allgather",), "pp": tuple(s.lower() for s in KNOWN_SCHEDULES)}
    if option is not None and option.lower() not in options.get(kind, ()):
        allowed = ", ".join(KNOWN_SCHEDULES) if kind == "pp" else ", ".join(options.get(kind, ())) or "none"
        raise LayoutError(f"layout {name!r}: {kind}{degree}:{option} has an unknown option (allowed: {allowed})")
    if kind == "ddp":
        degrees["dp_replicate"] = degree
    elif kind == "fsdp":
        degrees["dp_shard"] = degree
    elif kind == "hsdp":
        if degree < 4 or degree % 2:
            raise LayoutError(f"layout {name!r}: hsdp{degree} needs an even degree of at least 4 "
                              f"(2 replicas × {degree}/2 shards); or write ddpRxfsdpS")
        degrees["dp_replicate"], degrees["dp_shard"] = 2, degree // 2
    elif kind in ("tp", "pp", "cp", "ep"):
        degrees[kind] = degree
        if kind == "tp" and option:
            extra["parallelism.sequence_parallel"] = "false"
        if kind == "cp" and option:
            extra["parallelism.cp_rotate_method"] = "allgather"
        if kind == "pp" and option:
            extra["parallelism.pp_schedule"] = next(s for s in KNOWN_SCHEDULES if s.lower() == option.lower())


def fit_batch(layout: ParityLayout, local_batch_size: int, global_batch_size: int) -> ParityLayout:
    """``layout`` with the ``training.local_batch_size`` that keeps ``global_batch_size`` (the same
    samples per optimizer step as one process): ``global / (dp · N)`` for an ``accumN`` part, else the
    config's ``local_batch_size`` when dp × it divides the global batch, else the largest local batch
    below it that does (more accumulation, the same step).

    Raises:
        LayoutError: the global batch does not divide into dp (× N) microbatches.
    """
    o = layout.overrides
    dp = o["parallelism.dp_replicate"] * o["parallelism.dp_shard"]
    parts = dp * max(layout.accum, 1)
    if global_batch_size % parts:
        raise LayoutError(f"layout {layout.name!r}: training.global_batch_size {global_batch_size} does not split "
                          f"into dp {dp}" + (f" × {layout.accum} microbatches" if layout.accum else " ranks"))
    per_rank = global_batch_size // dp
    if layout.accum:
        local = per_rank // layout.accum
    else:
        local = max(b for b in range(1, min(local_batch_size, per_rank) + 1) if per_rank % b == 0)
    if local == local_batch_size and not layout.accum:
        return layout
    return ParityLayout(layout.name, layout.world_size, {**o, "training.local_batch_size": local}, layout.accum)


def candidate_layouts(moe: bool) -> list[str]:
    """Every layout ``--layouts auto`` considers, smallest first: each parallelism alone at degree 2
    (DDP, FSDP, HSDP, TP with and without sequence parallel, each pipeline schedule, CP with ring and
    all-gather, EP for MoE, accumulation alone and under FSDP), then 2-, 3- and 4-D combinations."""
    names = ["accum2", "ddp2", "fsdp2", "tp2", "tp2:nosp", "cp2", "cp2:allgather"]
    names += [f"pp2:{schedule}" for schedule in KNOWN_SCHEDULES]
    names += ["fsdp2xaccum2", "hsdp4", "fsdp2xtp2", "fsdp2xpp2", "fsdp2xcp2", "tp2xpp2", "cp2xtp2", "cp2xpp2",
              "ddp2xtp2"]
    names += ["fsdp2xtp2xpp2", "fsdp2xcp2xtp2", "pp2xcp2xtp2", "hsdp4xtp2"]
    names += ["fsdp2xpp2xcp2xtp2"]
    if moe:
        names += ["ep2", "fsdp2xep2", "ep2xtp2", "ep2xpp2", "fsdp2xep2xtp2", "ep2xpp2xtp2"]
    return names


def auto_layouts(process_budget: int, moe: bool) -> tuple[list[ParityLayout], list[str]]:
    """(layouts of :func:`candidate_layouts` within ``process_budget`` processes, names left out with
    the reason). Legality against the config is checked by the caller (:func:`check_layout`)."""
    kept, left_out = [], []
    for name in candidate_layouts(moe):
        layout = parse_layout(name)
        if layout.world_size > process_budget:
            left_out.append(f"{name}: needs {layout.world_size} processes, the budget is {process_budget}")
        else:
            kept.append(layout)
    return kept, left_out


def check_layout(cfg_argv: list[str], layout: ParityLayout, device_type: str) -> str | None:
    """None if the launcher's pre-flight accepts ``layout`` on top of ``cfg_argv`` (CLI-style config
    arguments), else its one-line reason."""
    from engine.config import ConfigError, load_config
    from engine.setup.preflight import check_setup

    argv = list(cfg_argv)
    for key, value in layout.overrides.items():
        argv += [f"--{key}", str(value)]
    try:
        cfg = load_config(argv)
        cfg.validate()
        check_setup(cfg, layout.world_size, device_type, check_data=False)
    except (ConfigError, ValueError, FileNotFoundError) as error:
        return str(error).splitlines()[0]
    return None
