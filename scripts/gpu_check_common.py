"""What every row of scripts/gpu_check.py shares: the :class:`Ctx` it receives, :class:`Skip`, the
tolerance, and the builders of the process group, the model, a synthetic batch and the trainer's loss.

Every row takes a :class:`Ctx` and returns ``{name: number or short string}``; it raises on a
failed check (the driver turns the exception into ``FAIL`` and one line) and :class:`Skip` when
the check does not apply. Rows are independent: a row that needs the process group or the mesh
calls :func:`process_group`, which creates them on first use. On the CPU (``Ctx.dry``) every row
runs the same code at a tiny shape, and calls that exist only for CUDA are left out and named.

Tolerances are relative L2 errors ``||a - b|| / ||b||`` against an fp32 reference: one bf16
rounding is 2^-9 ≈ 2e-3 relative, so a correct bf16 path lands near 1e-3 to 5e-3 and a wrong one
(a dropped expert, a wrong mask, a lost scale) near 1.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field

import torch

BF16_REL = 2e-2  # allowed relative L2 error of a bf16 result against its fp32 reference


class Skip(Exception):
    """The row does not apply here (its message says why); not a failure."""


@dataclass
class Ctx:
    """What every row sees: ``device`` (cuda:0, or cpu with ``dry``), the ``quick`` knob, the MFU
    shape (``mfu_shape``, ``seq_len`` tokens, ``batch`` sequences, ``steps`` timed after ``warmup``),
    ``compile`` for the MFU run, ``deadline`` (time.monotonic() by which the running row must end)
    and ``state`` (results shared between rows: process group, mesh, matmul TFLOP/s)."""

    device: torch.device
    dry: bool
    quick: bool
    mfu_shape: str = "3B"
    seq_len: int = 8192
    batch: int = 1
    steps: int = 10
    warmup: int = 3
    compile: bool = True
    deadline: float = math.inf
    state: dict = field(default_factory=dict)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want||_2 / ||want||_2 in float32 (0 when both are zero).

    Raises:
        AssertionError: ``got`` is None (a gradient that never arrived).
    """
    assert got is not None and want is not None, "a gradient is missing (None): that path did not reach it"
    got, want = got.detach().float(), want.detach().float()
    denominator = want.norm().item()
    return (got - want).norm().item() / denominator if denominator > 0 else (got - want).norm().item()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_group(ctx: Ctx):
    """The world-size-1 process group and mesh, through engine.train.distributed.init_distributed and
    ParallelDims.build_mesh (as a torchrun rank would); created once, then reused.

    Returns:
        (DistInfo, ParallelDims) with the 5-D mesh built on the device type.
    Raises:
        RuntimeError: launched with WORLD_SIZE > 1 (this check is one process).
    """
    if "dist" in ctx.state:
        return ctx.state["dist"], ctx.state["dims"]
    from engine.train.distributed import init_distributed
    from parallelisms.parallel_dims import ParallelDims

    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise RuntimeError("gpu_check is one process: run it without torchrun (WORLD_SIZE must be 1)")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    info = init_distributed("cpu" if ctx.dry else "auto", "auto", timeout_seconds=120)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    dims.build_mesh(info.device.type)
    ctx.state.update(dist=info, dims=dims)
    return info, dims


def small_args(ctx: Ctx, seq_len: int):
    """LlamaModelArgs of the bf16 and compile rows: 4 blocks of width 1024 (dry: 2 of width 64)."""
    from models.common.args import LlamaModelArgs

    if ctx.dry:
        return LlamaModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=seq_len)
    return LlamaModelArgs(dim=1024, n_layers=4, n_heads=16, n_kv_heads=8, vocab_size=32768, max_seq_len=seq_len)


def mfu_args(ctx: Ctx):
    """LLaMA-3.2 3B (Meta's release: dim 3072, 28 layers, 24 heads, 8 kv heads, SwiGLU width 8192,
    tied embeddings) or 1B (the engine's "1B" flavor, tied as released); a tiny shape when dry."""
    import dataclasses

    from models.common.args import LlamaModelArgs
    from models.llama.flavors import llama3_flavors

    if ctx.dry:
        return LlamaModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                              max_seq_len=ctx.seq_len, tie_embeddings=True)
    if ctx.mfu_shape == "1B":
        return dataclasses.replace(llama3_flavors["1B"], max_seq_len=ctx.seq_len, tie_embeddings=True)
    if ctx.mfu_shape == "3B":
        return LlamaModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, multiple_of=256,
                              ffn_dim_multiplier=1.0, rope_theta=500000.0, max_seq_len=ctx.seq_len,
                              tie_embeddings=True)
    raise ValueError(f"--mfu-shape {ctx.mfu_shape!r}: choose 1B or 3B")


def build_model(args, device: torch.device, seed: int = 0, parallelize=None):
    """Meta model → ``parallelize(model)`` → engine.setup.model_builder.materialize (to_empty + init)."""
    from engine.setup.model_builder import materialize
    from models.common.decoder import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    if parallelize is not None:
        parallelize(model)
    return materialize(model, device, seed)


def synthetic_batch(vocab: int, batch: int, seq_len: int, device: torch.device, seed: int = 0):
    """Uniform random token ids: (inputs, labels), LongTensor [batch, seq_len] each, shifted by one."""
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    tokens = tokens.to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def step_loss(model, inputs, labels):
    """The trainer's loss: token-sum cross entropy over the batch's label tokens (mean, nats)."""
    from engine.train.loss import token_sum_loss

    return token_sum_loss(model(inputs), labels, float(labels.numel()))
