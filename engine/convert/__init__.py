"""Offline conversion, one process, no process group: single-file export/import and seed checkpoints
(``tools.py``) and Hugging Face safetensors + config.json in both directions (``hf.py``, through the
family's adapter that ``hf_adapter.py`` finds). Built on the runtime checkpoint code
(engine/checkpoint/) and the rank-build recipe (engine/setup/)."""
