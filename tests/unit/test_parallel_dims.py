"""ParallelDims validation, the mesh it builds, and the start-up checks of the model builder."""

from __future__ import annotations

import types

import pytest

from models.resolve import resolve_model_args
from models.registry import get_model_spec
from parallelisms.parallel_dims import ParallelDims, ParallelismError
from engine.testing.processes import run_distributed


def dims(world_size, dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1):
    return ParallelDims(dp_replicate, dp_shard, cp, tp, pp, ep, world_size)


def test_dp_shard_minus_one_takes_the_rest():
    d = dims(8, dp_replicate=2)
    assert (d.dp_shard, d.dp, d.fsdp_enabled, d.ddp_enabled) == (4, 8, True, False)


def test_modes_by_degrees():
    assert dims(1).fsdp_enabled is False and dims(1).ddp_enabled is False
    assert dims(4, dp_shard=4).fsdp_enabled
    ddp = dims(2, dp_replicate=2, dp_shard=1)
    assert ddp.ddp_enabled and not ddp.fsdp_enabled
    hsdp = dims(4, dp_replicate=2, dp_shard=2)
    assert hsdp.fsdp_enabled and hsdp.dp_replicate_enabled and not hsdp.ddp_enabled


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world_size": 2, "dp_shard": 3}, "degrees multiply to 3"),
        ({"world_size": 4, "dp_replicate": 3}, "not divisible by dp_replicate×cp×tp×pp = 3"),
        ({"world_size": 2, "dp_shard": 0}, "parallelism.dp_shard = 0"),
        ({"world_size": 2, "dp_replicate": 0}, "parallelism.dp_replicate = 0"),
        ({"world_size": 4, "ep": 3}, "parallelism.ep = 3 must divide dp_shard×cp = 4"),
        # ep may span tp (a multiple of cp×tp dividing dp_shard×cp×tp): 4 over tp 2 × dp_shard 2 is valid now.
        ({"world_size": 4, "tp": 2, "ep": 8}, r"ep = 8 fits neither layout.*one of \[2, 4\]"),
        ({"world_size": 2, "dp_replicate": 2, "ep": 2}, r"or raise dp_shard, e.g. with a smaller dp_replicate, now 2\)"),
    ],
)
def test_invalid_degrees(kwargs, message):
    with pytest.raises(ParallelismError, match=message):
        dims(**kwargs)


def _mesh_coordinates():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    d = dims(4, dp_replicate=2, dp_shard=2)
    d.build_mesh("cpu")
    return {
        name: (d.mesh(name).size(), d.mesh(name).get_local_rank() if d.mesh(name).ndim == 1 else None)
        for name in ("dp", "dp_shard_cp", "dp_cp", "dp_replicate", "dp_shard", "tp")
    }


def test_mesh_sub_meshes_by_use():
    results = run_distributed(_mesh_coordinates, 4)
    # rank = dp_replicate * 2 + dp_shard; the flattened dp mesh orders ranks the same way.
    for rank, mesh in enumerate(results):
        assert mesh["dp"] == (4, rank)
        assert mesh["dp_cp"] == (4, rank)
        assert mesh["dp_shard_cp"] == (2, rank % 2)
        assert mesh["dp_replicate"] == (2, rank // 2)
        assert mesh["tp"] == (1, 0)


def model_cfg(**changes):
    settings = dict(name="llama", flavor="debugmodel", tokenizer_path="tok.model", vocab_size=-1, tie_embeddings=False)
    settings.update(changes)
    return types.SimpleNamespace(**settings)


def test_model_args_follow_config():
    _, args = resolve_model_args(model_cfg(vocab_size=8192, tie_embeddings=True), seq_len=128, tokenizer_vocab_size=4096)
    assert (args.vocab_size, args.tie_embeddings, args.max_seq_len) == (8192, True, 128)


def test_tokenizer_larger_than_model():
    with pytest.raises(ValueError, match=r"has 32000 tokens .* Set model.vocab_size >= 32000"):
        resolve_model_args(model_cfg(), seq_len=128, tokenizer_vocab_size=32000)


def test_seq_len_over_model_maximum_trains_with_rope_tables_of_that_length():
    """Context extension: the tables cover the run's length (the warning: tests/integration/test_long_context.py)."""
    from models.resolve import long_context_warning

    spec, args = resolve_model_args(model_cfg(), seq_len=4096, tokenizer_vocab_size=4096)
    assert args.max_seq_len == 4096
    base = spec.flavors["debugmodel"]
    assert "max_seq_len 2048" in long_context_warning(base, 4096, "llama/debugmodel")
    assert "RoPE frequencies (of every position): none (rope_theta 500000, unscaled)" in long_context_warning(base, 4096, "x")
    assert long_context_warning(base, 2048, "x") is None
    yarn = get_model_spec("deepseek_v3").flavors["debugmodel"]
    assert "YaRN (factor 4, original_max_seq_len 512" in long_context_warning(yarn, 4096, "x")


@pytest.mark.parametrize("field, value", [("name", "gpt"), ("flavor", "7B")])
def test_unknown_model_or_flavor(field, value):
    with pytest.raises(ValueError, match=f"model.{field}"):
        resolve_model_args(model_cfg(**{field: value}), seq_len=128, tokenizer_vocab_size=4096)
