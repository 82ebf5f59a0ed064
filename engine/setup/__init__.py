"""Resolving the job and building a rank's model, shared by every entry point: the start-up rules
(``preflight.py``, ``check_setup``: torch-free) and the one rank-build recipe (``model_builder.py``,
``build_model_parts``). The launcher, the ranks, the planner, the parity harness and the conversion
tools all call these; this package imports none of them."""
