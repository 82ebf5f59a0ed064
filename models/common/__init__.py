"""What every model family builds on: the decoder and its blocks, attention, RoPE (plain, llama3,
YaRN), the SwiGLU feed-forward, the mixture-of-experts layers and router, their tensor-parallel
plans, the planner's shapes and FLOPs, the Hugging Face conversion rules, init, document masking and
the fused loss. A family (``models/<family>/``) holds its flavors, its Hugging Face adapter and only
the modules that are its own, and imports nothing but this package and ``models.registry``
(tests/unit/test_architecture.py). Importing this package imports no torch: the modules that need it are
imported by name when a model is built (``models.registry.load_ref``).
"""
