"""Launch-time code, one process before any rank starts (torch-free until torchrun is handed over):
the launcher around torchrun (``launcher.py``, run as ``python -m engine.launch``; the environment it
reads and torchrun's command line: ``environment.py``) and ``--dry_run`` (``dry_run.py``). The start-up
rules they run are engine/setup/preflight.py's."""
