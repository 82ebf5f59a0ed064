"""Rank-time code, in every training process (``python -m engine.train`` under torchrun): the entry
point (``main.py``), the Trainer and its step recipe (``trainer.py``), the runners over the parallel
layout (``runner.py``), the rank's model build (``model_builder.py``), loss, optimizer, LR schedule,
process group (``distributed.py``) and stop signals (``signals.py``)."""
