"""Named LLaMA-3 sizes (`model.flavor`). Numbers follow Meta's released configurations: the 1B
(Llama 3.2) and 8B/70B/405B (Llama 3.1) flavors have Llama 3.1's RoPE scaling ("llama3": factor 32
for 3.2, 8 for 3.1; low/high frequency factors 1/4; original context 8192 tokens), which is what
makes their 131,072 positions (and a context extended past them) meaningful."""

from __future__ import annotations

from models.common.args import LlamaModelArgs

__all__ = ["llama3_flavors"]

llama3_flavors: dict[str, LlamaModelArgs] = {
    # ~6.8 M parameters: fast enough for CPU tests and the Shakespeare example.
    "debugmodel": LlamaModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=8,
        vocab_size=4096,
        multiple_of=256,
        rope_theta=500000.0,
        max_seq_len=2048,
    ),
    # ~0.6 M parameters, mostly the 4096-row embedding and output: the test suite's model (a step is
    # 3-4x cheaper than debugmodel's). Grouped-query attention like debugmodel, and its 8 / 4 heads
    # split over every tensor-parallel degree up to 4.
    "debugmodel_tiny": LlamaModelArgs(
        dim=64,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=4096,
        multiple_of=64,
        rope_theta=500000.0,
        max_seq_len=2048,
    ),
    # Llama 3.2 1B (Meta ships it with tied embeddings; here tying is `model.tie_embeddings`).
    "1B": LlamaModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_theta=500000.0,
        rope_scaling="llama3",
        rope_scaling_factor=32.0,
        max_seq_len=131072,
    ),
    # 8,030,261,248 parameters (untied).
    "8B": LlamaModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        rope_scaling="llama3",
        max_seq_len=131072,
    ),
    # 70,553,706,496 parameters (untied).
    "70B": LlamaModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_theta=500000.0,
        rope_scaling="llama3",
        max_seq_len=131072,
    ),
    "405B": LlamaModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        rope_theta=500000.0,
        rope_scaling="llama3",
        max_seq_len=131072,
    ),
}
