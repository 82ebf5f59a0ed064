"""The planner's text table and JSON (the same report for scripts/plan.py and ``--dry_run``)."""

from __future__ import annotations

import json

GIB = 1024**3
_DIM_SHORT = {"dp_shard_cp": "fsdp", "dp_replicate": "dp_rep", "dp_shard_mod_ep": "ep_fsdp", "dp_cp": "dp_cp",
              "tp": "tp", "cp": "cp", "ep": "ep", "pp": "pp"}


def degrees_text(degrees: dict) -> str:
    """"pp×dp_replicate×dp_shard×cp×tp" (and "ep N" when > 1), e.g. "1×1×8×1×8"."""
    text = "x".join(str(degrees[k]) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    return text + (f" ep{degrees['ep']}" if degrees.get("ep", 1) > 1 else "")


def table(records: list[dict], limit: int = 15) -> str:
    """One line per layout record (``LayoutEstimate.as_dict()``): degrees, AC, batch, memory (GiB: the
    state, activations at the loss, the gradient-reduction phase's non-state bytes, and the total =
    state + the larger of the loss phase and the reduction phase), communication per dim (GB of wire
    bytes per step), bubble, step time, MFU, fits."""
    head = (f"{'#':>2} {'pp x dpr x dps x cp x tp':<24} {'AC':<12} {'lbs/A/M':<9} "
            f"{'param':>6} {'grad':>6} {'optim':>6} {'act':>6} {'reduce':>6} {'total':>6} {'GPU':>5} "
            f"{'bubble':>6} {'step s':>7} {'MFU':>5} fits  comm GB/step/rank (wire)")
    lines = [head]
    for i, r in enumerate(records[:limit], 1):
        m = r["memory_bytes_per_rank"]
        comm = " ".join(f"{_DIM_SHORT.get(d, d)}={v['wire'] / 1e9:.3g}"
                        for d, v in r["comm_bytes_per_step_per_rank"].items() if v["wire"] >= 1e6)
        lines.append(
            f"{i:>2} {degrees_text(r['degrees']):<24} {r['activation_checkpoint']:<12} "
            f"{r['local_batch_size']}/{r['grad_accum']}/{r['pp_microbatches']:<5} "
            f"{m['params'] / GIB:6.1f} {m['grads'] / GIB:6.1f} {m['optimizer'] / GIB:6.1f} "
            f"{m['activations'] / GIB:6.1f} {m['reduction'] / GIB:6.1f} {m['total'] / GIB:6.1f} "
            f"{r['gpu_memory_bytes'] / GIB:5.0f} "
            f"{r['bubble']:6.3f} {r['step_time_s']:7.2f} {100 * r['mfu']:4.1f}% "
            f"{'yes ' if r['fits'] else 'NO  '} {comm}"
        )
    return "\n".join(lines)


def write_json(path: str, payload: dict) -> None:
    """Write ``payload`` (``{"model", "cluster", "decision", "layouts": [record, ...]}``) as JSON."""
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=False)
        f.write("\n")
