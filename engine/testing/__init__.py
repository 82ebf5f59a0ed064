"""What the test suite (tests/) and the benchmarks (scripts/benchmarks/) share to drive the engine, as
torch keeps its own in ``torch.testing``: running a function in N gloo processes (processes), faults
injected into a Trainer's steps (faults), and the peak memory of a step by kind (memory). Nothing in the
engine's training path imports it; scripts/ imports nothing from tests/.
"""
