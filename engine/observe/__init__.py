"""Observability: metrics (console, TensorBoard, JSONL), time attribution per mesh dim and its step
timing (``attribution.py``), profiling (``profiling.py``), FLOPs / MFU (``flops.py``), the one GPU
table (``hardware.py``, torch-free: peak FLOP/s, HBM bytes, bandwidths; MFU, the planner and the dry
run read it) and the step recorder of ``[record] step`` (``record.py``, read by engine/parity/)."""
