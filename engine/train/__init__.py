"""Rank-time code, in every training process (``python -m engine.train`` under torchrun): the entry
point (``main.py``), the Trainer and its step recipe (``trainer.py``), the runners over the parallel
layout (``runner.py``), loss, optimizer, LR schedule, process group (``distributed.py``) and stop
signals (``signals.py``). The rank's model is built by engine/setup/model_builder.py."""
