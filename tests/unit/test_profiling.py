"""engine/observe/profiling.py: a ``[profiling]`` run leaves a trace per rank that a trace viewer opens."""

from __future__ import annotations

import json
import os

from engine.testing.processes import run_distributed
from tests.training_utils import base_args, train_and_record


def test_trace_of_the_chosen_steps(tmp_path):
    argv = base_args(str(tmp_path), {"training.steps": 3, "profiling.enable": "true", "profiling.start_step": 2,
                                     "profiling.num_steps": 2, "profiling.memory_snapshot": "true"})
    run_distributed(train_and_record, 1, argv, torchrun_env=False, timeout=120)
    folder = tmp_path / "profile_traces"
    assert sorted(os.listdir(folder)) == ["rank0_step2-3.json"]  # no snapshot on the CPU (warned)
    with open(folder / "rank0_step2-3.json") as file:
        trace = json.load(file)  # Chrome trace format, what Perfetto and chrome://tracing read
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"aten::mm", "Optimizer.step#AdamW.step"} <= names, sorted(n for n in names if n)[:40]
