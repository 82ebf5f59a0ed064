"""./scripts/parity.py --locate: the re-assembly of records into the one-process view
(engine/parity/assemble.py) on hand-made records, the culprit rule (engine/parity/locate.py), and
sweeps through the real launcher in which a defect injected into one module of one layout
(tests/parity_defects/sitecustomize.py) must be named."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine.parity.assemble import AssemblyError, View, assemble, load_records
from engine.parity.locate import compare_views
from parallelisms.context_parallel import cp_positions
from tests.training_utils import REPO, base_args

SCRIPT = os.path.join(REPO, "scripts", "parity.py")
DEFECTS = os.path.join(REPO, "tests", "parity_defects")


def _call(t, shard=None, partial=False, counts=None):
    return {"t": t, "shard": shard, "partial": partial, "counts": counts}


def _record(inputs, modules, *, pp=0, dp=0, dp_size=1, cp=0, cp_size=1, tp=0, tp_size=1, positions=None,
            grads=None):
    coords = {"pp": pp, "dp": dp, "dp_size": dp_size, "cp": cp, "cp_size": cp_size, "tp": tp, "tp_size": tp_size}
    outs = {name: {"out": calls, "in": []} for name, calls in modules.items()}
    return {"rank": 0, "step": 1, "coords": coords, "positions": positions, "inputs": inputs, "modules": outs,
            "order": list(modules), "grads": grads or {}, "grad_order": list(grads or {})}


def test_tensor_parallel_shards_join_by_placement_and_by_shape():
    torch.manual_seed(0)
    inputs = [torch.randint(0, 50, (4, 8))]
    full = {name: torch.randn(4, 8, 6) for name in ("col", "seq", "replica", "dtensor", "partial")}
    reference = assemble([_record(inputs, {n: [_call(t)] for n, t in full.items()})])
    ranks = []
    for tp in range(2):
        half = slice(3 * tp, 3 * tp + 3)
        ranks.append(_record(inputs, {
            "col": [_call(full["col"][..., half])],                        # column parallel: features
            "seq": [_call(full["seq"][:, 4 * tp:4 * tp + 4])],             # sequence parallel: seq
            "replica": [_call(full["replica"])],
            "dtensor": [_call(full["dtensor"][:, 4 * tp:4 * tp + 4], shard=1)],
            "partial": [_call(full["partial"] * (0.25 if tp == 0 else 0.75), partial=True)],
        }, tp=tp, tp_size=2))
    view = assemble(ranks, reference)
    assert not view.skipped, view.skipped
    for name, tensor in full.items():
        assert torch.allclose(view.outputs[name], tensor.double()), name
    # A shape that is neither a replica nor a tp shard is reported, not guessed.
    ranks[1]["modules"]["col"]["out"][0]["t"] = torch.randn(4, 8, 2)
    ranks[0]["modules"]["col"]["out"][0]["t"] = torch.randn(4, 8, 2)
    assert "fits neither" in assemble(ranks, reference).skipped["col (out)"]


def test_context_and_data_parallel_go_back_to_one_process_order():
    """dp2 × cp2 with load-balanced positions, the dp ranks holding the samples in another order than
    one process, two accumulation microbatches each, and a flattened-token tensor (a router's)."""
    torch.manual_seed(0)
    samples = torch.randint(0, 50, (8, 8))
    out, router = torch.randn(8, 8, 5), torch.randn(8 * 8, 3)
    reference = assemble([_record([samples[:4], samples[4:]], {"block": [_call(out[:4]), _call(out[4:])],
                                                               "router": [_call(router[:32]), _call(router[32:])]})])
    positions = cp_positions(8, 2, load_balance=True)
    router_tokens = router.view(8, 8, 3)
    order = {0: [5, 4, 7, 6], 1: [1, 0, 3, 2]}  # dp rank -> the samples it trains, in its order
    ranks = []
    for dp, rows in order.items():
        for cp in range(2):
            mb = [rows[:2], rows[2:]]
            ranks.append(_record([samples[r] for r in mb], {
                "block": [_call(out[r][:, positions[cp]]) for r in mb],
                "router": [_call(router_tokens[r][:, positions[cp]].reshape(-1, 3)) for r in mb],
            }, dp=dp, dp_size=2, cp=cp, cp_size=2, positions=positions[cp]))
    view = assemble(ranks, reference)
    assert not view.skipped, view.skipped
    assert torch.equal(view.samples, samples)
    assert torch.equal(view.outputs["block"], out.double())
    assert torch.equal(view.outputs["router"], router_tokens.double())
    # Another sample than one process trained: the data differ, which the locator says instead.
    ranks[0]["inputs"][0] = ranks[0]["inputs"][0].clone().fill_(1)
    with pytest.raises(AssemblyError, match="the data differ"):
        assemble(ranks, reference)


def test_rows_grouped_by_expert_compare_as_per_expert_sums():
    rows, counts = torch.randn(6, 4), torch.tensor([3, 1, 2])
    reference = assemble([_record([torch.zeros(2, 3, dtype=torch.long)], {"experts": [_call(rows, counts=counts)]})])
    # Two dp ranks, each routing its own tokens (rows of expert 0: 2 + 1, expert 1: 0 + 1, expert 2: 1 + 1).
    a, b = rows[[0, 1, 4]], rows[[2, 3, 5]]
    ranks = [_record([torch.zeros(1, 3, dtype=torch.long)], {"experts": [_call(a, counts=torch.tensor([2, 0, 1]))]}, dp=0, dp_size=2),
             _record([torch.zeros(1, 3, dtype=torch.long)], {"experts": [_call(b, counts=torch.tensor([1, 1, 1]))]}, dp=1, dp_size=2)]
    view = assemble(ranks, reference)
    assert "experts" in view.grouped
    assert torch.allclose(view.outputs["experts"], reference.outputs["experts"])
    assert torch.allclose(reference.outputs["experts"][0], rows[:3].double().sum(0))


def _view(outputs, inputs, order, grads=None):
    view = View(outputs={k: torch.tensor(v, dtype=torch.float64) for k, v in outputs.items()},
                inputs={k: torch.tensor(v, dtype=torch.float64) for k, v in inputs.items()}, order=order)
    view.grads = {k: torch.tensor(v, dtype=torch.float64) for k, v in (grads or {}).items()}
    view.grad_order = list(grads or {})
    return view


def test_the_culprit_is_the_module_or_the_enclosing_code_whose_input_still_agrees():
    order = ["a.wq", "a.wo", "a", "b"]
    ones = {name: [1.0, 2.0] for name in order}
    reference = _view(ones, ones, order, {"b.w": [1.0], "a.w": [1.0]})
    # wo's input agrees and its output differs: the defect is in a.wo.
    found = compare_views(_view({**ones, "a.wo": [1.0, 2.1], "a": [1.0, 2.1]}, ones, order,
                                {"b.w": [1.0], "a.w": [1.5]}), reference, "float32")
    assert found["culprit"] == "a.wo" and found["first_module"]["name"] == "a.wo"
    assert found["first_grad"]["name"] == "a.w"  # backward order: b.w agrees
    # wo's input already differs but a's agrees: the code between a.wq and a.wo (inside a) is wrong.
    found = compare_views(_view({**ones, "a.wo": [1.0, 2.1], "a": [1.0, 2.1]}, {**ones, "a.wo": [1.0, 3.0]}, order),
                          reference, "float32")
    assert found["culprit"] == "a" and "own forward before a.wo" in found["explanation"]
    # Rounding (1e-7 relative) is not a difference at fp32; it is at fp64's 1e-12.
    close = {**ones, "a.wq": [1.0, 2.0 * (1 + 1e-7)]}
    assert compare_views(_view(close, ones, order), reference, "float32")["culprit"] is None
    assert compare_views(_view(close, ones, order), reference, "float64")["culprit"] == "a.wq"


def test_records_of_another_step_or_none_are_refused(tmp_path):
    with pytest.raises(AssemblyError, match="no rank-<r>.pt"):
        load_records(str(tmp_path))
    for rank, step in ((0, 1), (1, 2)):
        record = _record([torch.zeros(1, 2, dtype=torch.long)], {})
        record["step"] = step
        torch.save(record, tmp_path / f"rank-{rank}.pt")
    with pytest.raises(AssemblyError, match="different steps"):
        load_records(str(tmp_path))


def _locate_sweep(tmp_path, layouts: str, defects: str, steps: int, extra=()):
    argv = [a for a in base_args(str(tmp_path / "unused")) if a]
    report = tmp_path / "parity.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--layouts", layouts, "--steps", str(steps), "--locate",
                           "--keep_max_norm", "--json", str(report), *argv, *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "QUADRA_TEST_DEFECT": defects,
                               "PYTHONPATH": os.pathsep.join([DEFECTS, REPO])})
    assert report.exists(), proc.stdout + proc.stderr
    return proc, {row["layout"]: row for row in json.loads(report.read_text())["layouts"]}


def test_locate_names_the_module_of_a_defect_in_one_layout(tmp_path):
    """The MoE test model, one step, four layouts, each with a defect only it has: a row-parallel
    layer without its reduction (tp2), a RoPE offset on one cp rank (cp2), one expert's output dropped
    (ep2), one parameter's gradient reduced wrongly (fsdp2). Each must fail; the locator must name the
    module the forward defects are in, and for the backward one find every output equal and name the
    parameter as the first differing gradient."""
    proc, rows = _locate_sweep(tmp_path, "tp2,cp2,ep2,fsdp2", "tp_unreduced:layers.0.attention.wo,"
                               "cp_rope_offset:layers.1.attention,ep_drop:layers.2.feed_forward.experts,"
                               "dp_grad_scale:layers.1.attention.wq.weight", 1, ["--model.name", "moe"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL (step 1)" in proc.stdout and "0/4 layouts pass" in proc.stdout
    found = rows["fsdp2"]["locate"]
    assert found["culprit"] is None and not any(row["differs"] for row in found["modules"]), found["first_module"]
    assert found["first_grad"]["name"] == "layers.1.attention.wq.weight", found["first_grad"]
    assert "no module output differs" in proc.stdout
    for layout, module in (("tp2", "layers.0.attention.wo"), ("cp2", "layers.1.attention"),
                           ("ep2", "layers.2.feed_forward.experts")):
        found = rows[layout]["locate"]
        assert not rows[layout]["passed"] and found["step"] == 1, rows[layout]
        assert found["culprit"] == module, (layout, found["explanation"], found["first_module"])
        assert f"=> {module}" in proc.stdout
        # Everything before the culprit in forward order agrees (the locator is not merely lucky).
        before = [row for row in found["modules"] if row["name"] == found["first_module"]["name"]]
        index = found["modules"].index(before[0])
        assert index > 3 and not any(row["differs"] for row in found["modules"][:index])
        assert found["not_compared"] == [], found["not_compared"]


def test_locate_reruns_a_later_failing_step_from_the_same_weights(tmp_path):
    """A wrong scale in one pipeline stage from step 2 on: step 1 agrees, so the layout and one process
    re-run step 2 from one process's checkpoint of step 1, and the locator names the block."""
    proc, rows = _locate_sweep(tmp_path, "pp2:1F1B", "pp_scale:layers.4@2", 2)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = rows["pp2:1F1B"]["locate"]
    assert found["step"] == 2 and found["start"] == "both from one process's checkpoint step-1", found.get("start")
    assert found["culprit"] == "layers.4" and "its input agrees" in found["explanation"], found["explanation"]
    assert [row for row in found["modules"] if row["differs"]][0]["name"] == "layers.4"


def _record_one_process(folder, overrides: dict) -> View:
    from engine.config import load_config
    from engine.train.trainer import Trainer

    argv = ["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml"),
            *base_args(str(folder), {"training.steps": 2, "record.step": 2, "validation.enable": "false",
                                     "checkpoint.enable": "false", **overrides})]
    trainer = Trainer(load_config(argv))
    try:
        trainer.train()
    finally:
        trainer.close()
    records = load_records(str(folder / "record"))
    assert [r["step"] for r in records] == [2]
    return records


def test_recording_leaves_out_recomputation_and_keeps_the_microbatches(tmp_path):
    """One process records step 2 only; with full activation checkpointing (each block's forward runs
    again in backward) and two accumulation microbatches it records the same view as without."""
    plain = _record_one_process(tmp_path / "plain", {})
    recomputed = _record_one_process(tmp_path / "ac", {"activation_checkpoint.mode": "full",
                                                       "training.local_batch_size": 4})
    assert {len(m["out"]) for m in plain[0]["modules"].values()} == {1}
    assert {len(m["out"]) for m in recomputed[0]["modules"].values()} == {2}  # two microbatches, no recompute
    reference = assemble(plain)
    view = assemble(recomputed, reference)
    assert not view.skipped and not reference.skipped
    assert reference.grad_order[0] == "output.weight"  # backward order: the last layer's gradient first
    found = compare_views(view, reference, "float32")
    assert found["culprit"] is None and found["first_grad"] is None, (found["first_module"], found["first_grad"])
    assert len(found["modules"]) == len(reference.order) > 50 and len(found["grads"]) == len(reference.grads)
