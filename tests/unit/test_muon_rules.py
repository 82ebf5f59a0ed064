"""engine/train/muon.py's rules one by one, against torch's own Muon (``torch.optim._muon``'s Newton–Schulz and
learning-rate adjustment), the quintic iteration written out in float64 (Keller Jordan's post), DTensor placements
enumerated by hand, and the round-robin property of the owner choice. Unit level, one process, about a second:
the fast selection scripts/mutation.sh runs for this module (tests/integration/test_muon.py holds whole steps bitwise to
torch.optim.Muon + AdamW).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from engine.train.muon import (DEFAULT_NS_COEFFICIENTS, NS_EPS, MuonWithAdamW, _Owners, adjusted_lr,
                               sharded_matrix_dims, zeropower_via_newtonschulz)

SHAPES = [(48, 32), (32, 48), (24, 24), (64, 8)]  # tall (transposed by the iteration), wide, square, very tall


@pytest.mark.parametrize("shape", SHAPES)
def test_newton_schulz_is_torchs_in_bfloat16(shape):
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    for steps, coefficients in ((5, DEFAULT_NS_COEFFICIENTS), (3, (2.0, -1.5, 0.5))):
        got = zeropower_via_newtonschulz(grad, coefficients, steps, NS_EPS)
        want = _zeropower_via_newtonschulz(grad, coefficients, steps, NS_EPS)
        assert got.dtype == torch.bfloat16 and got.shape == shape
        assert torch.equal(got, want)


def _quintic_by_hand(grad: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """X = G / max(||G||_F, eps) on the wide side; X <- a X + b (X X^T) X + c (X X^T)^2 X, in float64."""
    a, b, c = coefficients
    x = grad.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / max(x.norm().item(), eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", SHAPES)
def test_newton_schulz_in_float64_is_the_quintic_iteration(shape):
    grad = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    before = grad.clone()
    got = zeropower_via_newtonschulz(grad, DEFAULT_NS_COEFFICIENTS, 5, NS_EPS, dtype=torch.float64)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _quintic_by_hand(grad, DEFAULT_NS_COEFFICIENTS, 5, NS_EPS), rtol=1e-10, atol=1e-12)
    assert torch.equal(grad, before)  # the momentum buffer is never changed in place
    # the point of it: singular values pushed towards 1 (Keller Jordan's coefficients leave them in ~(0.5, 1.5))
    singular = torch.linalg.svdvals(got)
    assert singular.min() > 0.3 and singular.max() < 1.3
    # a tiny matrix is scaled by 1 / eps, not by its own norm (the clamp)
    small = torch.full((4, 6), 1e-9, dtype=torch.float64)
    got = zeropower_via_newtonschulz(small, DEFAULT_NS_COEFFICIENTS, 1, 1e-3, dtype=torch.float64)
    torch.testing.assert_close(got, _quintic_by_hand(small, DEFAULT_NS_COEFFICIENTS, 1, 1e-3), rtol=1e-12, atol=0)


@pytest.mark.parametrize("args, words", [
    ((torch.ones(4, 4), DEFAULT_NS_COEFFICIENTS, 100, NS_EPS), "less than 100"),
    ((torch.ones(2, 4, 4), DEFAULT_NS_COEFFICIENTS, 5, NS_EPS), "2D matrix"),
    ((torch.ones(4, 4), (1.0, 2.0), 5, NS_EPS), "exactly 3"),
])
def test_newton_schulz_refuses_what_torch_refuses(args, words):
    messages = []
    for function in (zeropower_via_newtonschulz, _zeropower_via_newtonschulz):
        with pytest.raises(ValueError, match=words) as error:
            function(*args)
        messages.append(str(error.value))
    assert messages[0] == messages[1]  # torch's words, verbatim
    zeropower_via_newtonschulz(torch.ones(4, 4), DEFAULT_NS_COEFFICIENTS, 99, NS_EPS)  # 99 steps are allowed


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("shape", SHAPES + [(1, 7), (7, 1)])
def test_adjusted_lr_is_torchs(adjust, shape):
    assert adjusted_lr(0.02, adjust, *shape) == pytest.approx(_adjust_lr(0.02, adjust, torch.Size(shape)), rel=1e-15)


class _FakeMesh:
    def __init__(self, *sizes: int) -> None:
        self.sizes = sizes

    def size(self, dim: int) -> int:
        return self.sizes[dim]


class _FakeDTensor:
    """What sharded_matrix_dims reads of a DTensor: _spec, device_mesh, placements, ndim."""

    def __init__(self, ndim: int, *placements) -> None:
        self._spec, self.ndim, self.placements = object(), ndim, placements
        self.device_mesh = _FakeMesh(*[2] * len(placements))


@pytest.mark.parametrize("ndim, placements, want", [
    (2, (Shard(0),), (0,)),                                   # FSDP2 rows
    (2, (Replicate(), Shard(1)), (1,)),                       # tensor parallel columns, replicated dim 0
    (2, (Shard(0), Shard(1)), (0, 1)),                        # FSDP x TP
    (2, (_StridedShard(0, split_factor=2), Shard(0)), (0, 1)),  # FSDP2 over TP rows
    (2, (Shard(-1),), (0,)),                                  # a negative dim is still a matrix dim
    (3, (Shard(0),), ()),                                     # expert parallel: whole experts, no gather
    (3, (Shard(0), Shard(1)), (1,)),                          # EP x FSDP inside an expert
    (3, (Shard(-2),), (0,)),
    (3, (Replicate(), Replicate()), ()),
])
def test_sharded_matrix_dims_are_the_mesh_dims_that_split_a_matrix(ndim, placements, want):
    assert sharded_matrix_dims(_FakeDTensor(ndim, *placements)) == want


def test_plain_tensors_have_no_sharded_dims():
    assert sharded_matrix_dims(torch.ones(4, 4)) == ()
    half = _FakeDTensor(2, Shard(0))
    del half.device_mesh  # a _spec without a mesh is no DTensor
    assert sharded_matrix_dims(half) == ()


def test_owners_go_round_robin_over_the_piece_holders():
    """Over every mesh_size consecutive matrices of one (mesh, dims), each rank owns exactly one; another
    (mesh, dims) keeps its own count."""
    owners, mesh, other = _Owners(), _FakeMesh(2, 3, 4), _FakeMesh(2, 3, 4)
    for dims in ((0, 1), (2,), (0, 2), (1,)):
        sizes = [mesh.sizes[d] for d in dims]
        everyone = set(itertools.product(*[range(s) for s in sizes]))
        for _ in range(2):  # two full rounds
            got = [owners.owner(mesh, dims) for _ in range(math.prod(sizes))]
            assert set(got) == everyone and len(got) == len(everyone), (dims, got)
    assert owners.owner(other, (0, 1)) == (0, 0)  # its own count
    assert owners.owner(mesh, (0, 1)) == (0, 0)  # the third round starts where the first did


def _groups(matrix: torch.nn.Parameter, vector: torch.nn.Parameter, **muon) -> list[dict]:
    muon_group = {"params": [matrix], "name": "hidden", "algorithm": "muon", "lr": 0.05, "weight_decay": 0.1,
                  "momentum": 0.9,
                  "nesterov": True, "ns_coefficients": DEFAULT_NS_COEFFICIENTS, "ns_steps": 5, "eps": NS_EPS,
                  "adjust_lr_fn": "original", "ns_dtype": "float32", **muon}
    adamw_group = {"params": [vector], "name": "vectors", "algorithm": "adamw", "lr": 0.01, "weight_decay": 0.0}
    return [muon_group, adamw_group]


def test_one_step_is_torch_muon_and_a_closure_runs_with_grad():
    """A step: torch.optim.Muon's arithmetic on the matrix (float32 NS here: the bfloat16 kernel is torch's own,
    checked above), AdamW on the vector; closure's loss returned; a parameter without grad left alone."""
    torch.manual_seed(2)
    matrix, vector, idle = (torch.nn.Parameter(torch.randn(shape)) for shape in ((48, 32), (32,), (8, 8)))
    groups = _groups(matrix, vector)
    groups[0]["params"].insert(0, idle)  # first: the parameters after it are still stepped
    optimizer = MuonWithAdamW(groups, {"lr": 0.01, "foreach": False})
    ref_matrix, ref_vector = matrix.detach().clone(), torch.nn.Parameter(vector.detach().clone())
    adamw = torch.optim.AdamW([ref_vector], lr=0.01, weight_decay=0.0, foreach=False)
    idle_before, buf = idle.detach().clone(), torch.zeros(48, 32)
    for step in range(2):
        grad = torch.randn(48, 32, generator=torch.Generator().manual_seed(10 + step))
        vector_grad = torch.randn(32, generator=torch.Generator().manual_seed(20 + step))
        matrix.grad, vector.grad, ref_vector.grad = grad.clone(), vector_grad.clone(), vector_grad.clone()

        def closure():
            assert torch.is_grad_enabled()
            return torch.tensor(float(step))
        assert optimizer.step(closure).item() == step
        adamw.step()
        buf = buf * 0.9 + grad * 0.1  # lerp(grad, 1 - mu); Nesterov: grad.lerp(buf, mu)
        update = grad * 0.1 + buf * 0.9
        ortho = _quintic_by_hand(update, DEFAULT_NS_COEFFICIENTS, 5, NS_EPS).float()
        ref_matrix = ref_matrix * (1 - 0.05 * 0.1) - 0.05 * math.sqrt(48 / 32) * ortho
        torch.testing.assert_close(matrix.detach(), ref_matrix, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(vector.detach(), ref_vector.detach(), rtol=0, atol=0)
    assert torch.equal(idle.detach(), idle_before) and "momentum_buffer" not in optimizer.state[idle]


def test_plain_momentum_and_match_rms_adamw():
    torch.manual_seed(3)
    matrix, vector = torch.nn.Parameter(torch.randn(16, 40)), torch.nn.Parameter(torch.randn(4))
    optimizer = MuonWithAdamW(_groups(matrix, vector, nesterov=False, adjust_lr_fn="match_rms_adamw",
                                      ns_dtype="float64"), {"lr": 0.01})
    start = matrix.detach().double().clone()
    grad = torch.randn(16, 40)
    matrix.grad, vector.grad = grad.clone(), torch.zeros(4)
    optimizer.step()
    ortho = _quintic_by_hand(grad * 0.1, DEFAULT_NS_COEFFICIENTS, 5, NS_EPS)  # plain momentum: buf itself
    want = start * (1 - 0.05 * 0.1) - 0.05 * 0.2 * math.sqrt(40) * ortho
    torch.testing.assert_close(matrix.detach().double(), want, rtol=1e-5, atol=1e-6)


def test_muon_refuses_vectors_and_unknown_algorithms():
    matrix, vector = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    groups = _groups(matrix, vector)
    groups[0]["params"].append(vector)
    with pytest.raises(ValueError, match=r"param group 'hidden': Muon needs 2-D.*\(4,\)"):
        MuonWithAdamW(groups, {"lr": 0.01})
    groups = _groups(matrix, vector)
    groups[1]["algorithm"] = "sgd"
    with pytest.raises(ValueError, match="param group 'vectors': algorithm 'sgd' is not muon or adamw"):
        MuonWithAdamW(groups, {"lr": 0.01})
    # a group whose parameter became a vector after construction is refused at the step
    optimizer = MuonWithAdamW(_groups(matrix, vector), {"lr": 0.01})
    optimizer.param_groups[0]["params"] = [vector]
    vector.grad = torch.ones(4)
    with pytest.raises(ValueError, match=r"Muon needs 2-D matrices or 3-D.*\(4,\)"):
        optimizer.step()


@pytest.mark.parametrize("ns_dtype", ["bfloat16", "float32"])
def test_sharded_path_on_a_one_rank_mesh_equals_the_plain_step(ns_dtype):
    """The gather / owner / broadcast / slice path of DTensor parameters (a 2-D matrix sharded on both matrix dims
    of a (dp_shard, tp) mesh, tall so the result is a transposed view; a 3-D expert weight sharded on experts and
    on a matrix dim) on a one-rank gloo mesh, where every collective is the identity: the step is the plain
    tensors' step bit for bit."""
    import torch.distributed as dist

    from engine.planner.real_plan import forget_meshes
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
        torch.manual_seed(4)
        plain = [torch.nn.Parameter(torch.randn(48, 32)), torch.nn.Parameter(torch.randn(4, 32, 24)),
                 torch.nn.Parameter(torch.randn(8))]
        placements = [(Shard(0), Shard(1)), (Shard(0), Shard(2)), (Replicate(), Replicate())]
        sharded = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, pl))
                   for p, pl in zip(plain, placements)]
        assert sharded_matrix_dims(sharded[0]) == (0, 1) and sharded_matrix_dims(sharded[1]) == (1,)
        optimizers = []
        for params in (plain, sharded):
            groups = _groups(params[0], params[2], ns_dtype=ns_dtype)
            groups[0]["params"].append(params[1])
            optimizers.append(MuonWithAdamW(groups, {"lr": 0.01, "foreach": False}))
        for step in range(2):
            grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(30 + step)) for p in plain]
            for p, q, g, pl in zip(plain, sharded, grads, placements):
                p.grad, q.grad = g.clone(), distribute_tensor(g.clone(), mesh, pl)
            for optimizer in optimizers:
                optimizer.step()
            for p, q in zip(plain, sharded):
                assert torch.equal(p.detach(), q.detach().to_local()), (step, tuple(p.shape))
    finally:
        dist.destroy_process_group()
        forget_meshes()  # DTensor's caches hold this mesh: a process forked later crashed clearing them


def test_muon_alone_needs_no_adamw_group():
    matrix = torch.nn.Parameter(torch.randn(8, 8))
    optimizer = MuonWithAdamW(_groups(matrix, torch.nn.Parameter(torch.randn(2)))[:1], {"lr": 0.01})
    before = matrix.detach().clone()
    matrix.grad = torch.randn(8, 8)
    optimizer.step()
    assert not torch.equal(matrix.detach(), before)
