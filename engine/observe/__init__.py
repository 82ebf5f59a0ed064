"""Observability: metrics (console, TensorBoard, JSONL), time attribution per mesh dim and its step
timing (``attribution.py``), profiling (``profiling.py``) and FLOPs / MFU (``flops.py``, reading the
one GPU table of engine/observe/hardware.py)."""
