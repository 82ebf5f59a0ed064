"""engine/planner: the torch-free placement formulas give the real plan's local shards byte for byte
(built on the meta device under a fake process group, one process), the bubble follows the
schedules' published figures, scripts/plan.py's JSON and errors, and the presets fit their GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.training_utils import REPO, base_args

# name: (world_size, overrides) — uneven shards: dp_shard 3 splits the 4096-row embedding and every
# 256/768-wide weight unevenly; MoE with ep; pipeline stages; TP inside FSDP; HSDP.
REAL_PLAN_LAYOUTS = {
    "fsdp3_uneven": (3, {"parallelism.dp_shard": 3}),
    "hsdp2x3_uneven": (6, {"parallelism.dp_replicate": 2, "parallelism.dp_shard": 3}),
    "tp2_fsdp3": (6, {"parallelism.tp": 2, "parallelism.dp_shard": 3}),
    "ddp2_tp2": (4, {"parallelism.dp_replicate": 2, "parallelism.dp_shard": 1, "parallelism.tp": 2}),
    "pp2_fsdp2": (4, {"parallelism.pp": 2, "parallelism.dp_shard": 2, "parallelism.pp_microbatch_size": 2}),
    "pp2_interleaved_tp2": (4, {"parallelism.pp": 2, "parallelism.tp": 2, "parallelism.dp_shard": 1,
                                "parallelism.pp_schedule": "Interleaved1F1B", "parallelism.pp_microbatch_size": 2}),
    "cp2_fsdp2": (4, {"parallelism.cp": 2, "parallelism.dp_shard": 2}),
    "moe_ep4": (4, {"model.name": "moe", "parallelism.dp_shard": 4, "parallelism.ep": 4}),
    "moe_ep2_fsdp6": (6, {"model.name": "moe", "parallelism.dp_shard": 6, "parallelism.ep": 2}),
    "moe_ep2_cp2_tp2": (8, {"model.name": "moe", "parallelism.dp_shard": 2, "parallelism.cp": 2,
                            "parallelism.ep": 2, "parallelism.tp": 2}),
    # Qwen3: head_dim apart from dim / n_heads, QK-norm weights replicated on tp with and without
    # sequence parallel; the published 8B and 30B-A3B (meta device, every rank).
    "qwen3_tp2_fsdp3_uneven": (6, {"model.name": "qwen3", "parallelism.tp": 2, "parallelism.dp_shard": 3}),
    "qwen3_tp2_nosp_fsdp2": (4, {"model.name": "qwen3", "parallelism.tp": 2, "parallelism.dp_shard": 2,
                                 "parallelism.sequence_parallel": "false"}),
    "qwen3_moe_ep2_tp2_fsdp2": (4, {"model.name": "qwen3_moe", "parallelism.dp_shard": 2, "parallelism.ep": 2,
                                    "parallelism.tp": 2}),
    "qwen3_8B_tp2_fsdp4": (8, {"model.name": "qwen3", "model.flavor": "8B", "parallelism.tp": 2,
                               "parallelism.dp_shard": 4}),
    "qwen3_moe_30B_A3B_ep8": (8, {"model.name": "qwen3_moe", "model.flavor": "30B-A3B", "parallelism.dp_shard": 8,
                                  "parallelism.ep": 8}),
    # DeepSeek-V3: MLA's latents and their norms replicated on tp, its per-head projections split;
    # the full-rank query without sequence parallel, uneven FSDP; 16B under ep 8 (meta device).
    "deepseek_v3_ep2_tp2_fsdp2": (4, {"model.name": "deepseek_v3", "model.flavor": "debugmodel",
                                      "parallelism.dp_shard": 2, "parallelism.ep": 2, "parallelism.tp": 2}),
    "deepseek_v3_full_q_tp2_nosp_fsdp3": (6, {"model.name": "deepseek_v3", "model.flavor": "debugmodel_noqlora",
                                              "parallelism.tp": 2, "parallelism.dp_shard": 3,
                                              "parallelism.sequence_parallel": "false"}),
    # multi-token prediction: its modules beside the output head in FSDP's root unit, their experts over ep
    "deepseek_v3_mtp_ep2_fsdp2": (2, {"model.name": "deepseek_v3", "model.flavor": "debugmodel_mtp",
                                      "parallelism.dp_shard": 2, "parallelism.ep": 2}),
    # under pp the last stage also holds a copy of the embedding for MTP (parallelisms/pipeline_tied.py)
    "deepseek_v3_mtp_pp2_tp2": (4, {"model.name": "deepseek_v3", "model.flavor": "debugmodel_mtp",
                                    "parallelism.pp": 2, "parallelism.tp": 2, "parallelism.dp_shard": 1}),
    "deepseek_v3_16B_ep8": (8, {"model.name": "deepseek_v3", "model.flavor": "16B", "parallelism.dp_shard": 8,
                                "parallelism.ep": 8}),
}


def _cfg(overrides: dict):
    from engine.config import load_config

    cfg = load_config(base_args("/tmp/unused", {"training.global_batch_size": -1, **overrides}))
    cfg.validate()
    return cfg


@pytest.mark.parametrize("name", sorted(REAL_PLAN_LAYOUTS))
def test_formula_state_bytes_equal_real_plan(name):
    """Every rank of the layout (its real plan built under the fake PG) holds exactly the parameter,
    gradient and optimizer bytes the placement formulas give for its mesh coordinate."""
    from engine.planner.layout import Layout
    from engine.planner.memory import state_bytes
    from tests.planner_runs import real_plan_states

    world_size, overrides = REAL_PLAN_LAYOUTS[name]
    cfg = _cfg(overrides)
    layout = Layout.from_config(cfg, world_size, "cpu")
    seen = set()
    for rank, (coords, real) in enumerate(real_plan_states(cfg, world_size, list(range(world_size)))):
        formula = state_bytes(layout, coords)
        assert formula == real, (rank, coords, formula, real)
        seen.add(real.params)
    if "uneven" in name:
        assert len(seen) > 1, "the layout was meant to give ranks different shard sizes"


def test_bubble_matches_schedules():
    from engine.planner.schedule import bubble_fraction
    from parallelisms.pipeline_timing import gpipe_bubble_fraction

    for k, m in ((2, 1), (2, 4), (4, 4), (4, 16), (8, 32)):
        for schedule in ("GPipe", "1F1B"):
            assert bubble_fraction(schedule, k, m) == pytest.approx((k - 1) / (m + k - 1))
            assert bubble_fraction(schedule, k, m) == pytest.approx(gpipe_bubble_fraction(k, m))
    # Megatron-LM interleaved (Narayanan et al. 2021 §2.2): the bubble shrinks by v.
    assert bubble_fraction("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / (2 * 8 + 3))
    # ZB-H1 (Qi et al. 2024 §3): a third of 1F1B's bubble time.
    assert bubble_fraction("InterleavedZeroBubble", 4, 8, 2) == pytest.approx(3 / (3 * 2 * 8 + 3))
    # ZB-V: zero when M >= 2K.
    assert bubble_fraction("ZBVZeroBubble", 4, 8, 2) == 0.0
    assert bubble_fraction("ZBVZeroBubble", 4, 4, 2) > 0.0


def _plan(*args, check=True):
    return subprocess.run([sys.executable, os.path.join(REPO, "scripts", "plan.py"), *args], cwd=REPO,
                          capture_output=True, text=True, check=check, timeout=120)


def test_plan_script_json(tmp_path):
    out = tmp_path / "plan.json"
    result = _plan("--model", "llama", "--flavor", "8B", "--gpus", "8", "--gpu", "H100-80GB",
                   "--seq_len", "8192", "--global_batch_size", "32", "--json", str(out))
    # 8B: its 16 bytes/parameter of state (120 GiB) cannot fit one GPU; sharded over 8 it does.
    assert "decision matrix: row 2" in result.stdout, result.stdout
    data = json.loads(out.read_text())
    record = data["layouts"][0]
    assert record["fits"] and set(record) >= {"degrees", "memory_bytes_per_rank", "comm_bytes_per_step_per_rank",
                                              "bubble", "step_time_s", "mfu", "fits"}
    memory = record["memory_bytes_per_rank"]
    assert set(memory) >= {"params", "grads", "optimizer", "activations", "transient", "reduction",
                           "peak_nonstate", "total"}
    # The loss and gradient-reduction phases never coexist: the total takes the larger, not the sum.
    assert memory["peak_nonstate"] == max(memory["activations"] + memory["transient"], memory["reduction"])
    assert memory["total"] == memory["params"] + memory["grads"] + memory["optimizer"] + memory["peak_nonstate"]
    assert 0 < record["mfu"] < 1


@pytest.mark.parametrize("args, needle", [
    (["--flavor", "70B", "--gpus", "0"], "--gpus 0 must be >= 1"),
    (["--flavor", "70B", "--gpus", "8", "--gpu", "V100"], "--gpu 'V100' is not in the hardware table"),
    (["--flavor", "7B", "--gpus", "8"], "--flavor '7B' is not a flavor of llama"),
    (["--model", "gpt", "--flavor", "8B", "--gpus", "8"], "--model 'gpt' is not a registered model"),
    (["--config", "nope.toml", "--flavor", "8B", "--gpus", "8"], "--config nope.toml: no such file"),
    (["--flavor", "8B", "--gpus", "8", "--json", "/tmp"], "--json /tmp is a folder"),
    (["--flavor", "8B", "--gpus", "8", "--gpu", "A100"], "--gpu 'A100' is ambiguous; use A100-40GB or A100-80GB"),
    (["--flavor", "8B", "--gpus", "8", "--top", "0"], "--top 0 must be >= 1"),
])
def test_plan_script_refuses_bad_input(args, needle):
    result = _plan(*args, check=False)
    assert result.returncode == 2 and needle in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# preset: GPUs its header states
PRESETS = {"llama3_8b.toml": 8, "llama3_70b.toml": 64, "llama3_405b.toml": 512, "moe_16b.toml": 8}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_fit_their_gpus(preset):
    """Each preset fits an H100 80GB at the GPU count its header states, per the planner."""
    from engine.config import load_config
    from engine.planner.estimate import estimate
    from engine.observe.hardware import get_gpu
    from engine.planner.layout import Layout

    cfg = load_config(["--job.config_file", os.path.join(REPO, "train_configs", preset)])
    cfg.validate()
    est = estimate(Layout.from_config(cfg, PRESETS[preset]), get_gpu("H100-80GB"), 8)
    assert est.fits, (preset, est.memory.as_dict())


def test_plan_script_takes_a_global_batch_smaller_than_the_default_local_batch():
    """Each candidate layout chooses its local batch: --global_batch_size 4 on 8 GPUs is valid."""
    result = _plan("--flavor", "8B", "--gpus", "8", "--global_batch_size", "4", "--top", "1", check=False)
    assert result.returncode == 0 and "global batch 4 sequences" in result.stdout, result.stderr
