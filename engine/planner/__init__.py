"""The layout planner: per-rank memory, communication, bubble and step time of a parallel layout.

- ``layout``: one candidate layout (degrees, microbatches, AC mode, dtypes), from a config or built.
- ``params``: every parameter's global shape and its placement under the model's plan, so the local
  shard of any rank follows without building the model (tests check it equals the real plan).
- ``memory``, ``comm``, ``schedule``: the per-rank formulas; ``estimate`` puts them together with the
  hardware (a GPU of engine/observe/hardware.py) into a step time and MFU; ``search`` ranks layouts
  and names the decision-matrix row.
- ``real_plan``: the same per-rank bytes read from the real plan built on the meta device under a
  fake process group (the ``--dry_run`` path, engine/launch/dry_run.py).
- ``report``: the text table and the JSON.
"""
