"""The paths and oracle checks of tests/unit/test_recipe_oracles.py's table, one process on CPU.

A model path is a registered family (models/registry.py) at its smallest flavor, and the family with
multi-token prediction where a flavor has prediction blocks (``ModelSpec.prediction_blocks``). A loss
path is a runner of engine/train/runner.py (the whole model, or the pipeline's stages) times the loss
``loss.chunk_tokens`` chooses (0: logits and engine/train/loss.py's ``token_sum_loss``; > 0: the fused
loss of models/common/linear_cross_entropy.py). The models are built by the product's own recipe
(``check_setup`` then ``build_model_parts``, the ``[loss]`` and ``[float8]`` settings applied there),
once per module (:class:`Builds`). The pipeline's stages run in this process in stage order: each
gets the keyword inputs a schedule gives it and the last one's output goes through the run's stage
loss function (engine/train/loss.py ``last_stage_loss``), so what differs from a 2-rank pipeline is
only the transport of activations (tests/integration/test_pipeline*.py hold that to one process).

The MoE families' sequence-wise balance loss (``aux_loss_coeff``) is turned off in these builds: it is
an objective of its own (tests/unit/test_moe*.py), a statistic of the whole sequence that no oracle of
the loss here writes, and it would make a document alone differ from its packed window.
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import math

import torch
import torch.nn.functional as F

from engine.config import load_config
from engine.config.param_groups import clean_name
from engine.setup.model_builder import build_model_parts
from engine.setup.preflight import check_setup
from engine.train.documents import DocumentInputs
from engine.train.loss import ZLoss, last_stage_loss
from engine.train.runner import SingleRunner, StepContext
from models.common.document_mask import document_ids
from models.registry import get_model_spec, list_model_names
from parallelisms.pipeline_tied import sum_tied_gradients
from tests.unit.test_deepseek_v3_mtp import WEIGHT as MTP_WEIGHT, _reference as mtp_reference
from tests.unit.test_document_mask import BOS, packed_window

SEQ = 24
RUNNER_PATHS = {"SingleRunner": "", "PipelineRunner": "pp_last_stage/"}  # runner class -> loss path prefix
LOSS_KINDS = {"unfused": 0, "fused": 16}  # loss path suffix -> loss.chunk_tokens
CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class ModelPath:
    """``name`` (the table's key), the registry's ``family`` and its smallest ``flavor`` on the path."""

    name: str
    family: str
    flavor: str
    mtp: bool


def model_paths() -> dict[str, ModelPath]:
    """Every model path of the registry: each family, and ``<family>+mtp`` when a flavor has
    multi-token-prediction blocks; the smallest flavor of each (``ModelSpec.param_shapes``' count)."""
    paths = {}
    for family in list_model_names():
        spec = get_model_spec(family)
        blocks = spec.get("prediction_blocks") if spec.prediction_blocks is not None else (lambda args: ())
        size = lambda args: sum(math.prod(p.shape) for p in spec.get("param_shapes")(args))  # noqa: E731
        for mtp in (False, True):
            flavors = sorted(f for f, args in spec.flavors.items() if bool(blocks(args)) == mtp)
            if flavors:
                name = family + "+mtp" * mtp
                paths[name] = ModelPath(name, family, min(flavors, key=lambda f: size(spec.flavors[f])), mtp)
    return paths


def loss_paths(runner_names: list[str]) -> list[str]:
    """The loss paths of ``runner_names`` (engine/train/runner.py's runner classes) with a known prefix."""
    return [RUNNER_PATHS[r] + kind for r in runner_names if r in RUNNER_PATHS for kind in LOSS_KINDS]


def config(path: ModelPath, *, pp: bool = False, overrides: list[str] = ()):
    """(validated ``JobConfig``, ``SetupPlan``) of ``path``: seq 24, 2 sequences, ``pp`` 2 or one process."""
    argv = ["--model.name", path.family, "--model.flavor", path.flavor, "--training.seq_len", str(SEQ),
            "--training.local_batch_size", "2", "--parallelism.dp_shard", "1", "--parallelism.pp", str(1 + pp),
            "--loss.mtp_weight", str(MTP_WEIGHT if path.mtp else 0.0), "--optimizer.implementation", "for-loop"]
    cfg = load_config([*argv, *overrides])
    cfg.validate()
    return cfg, check_setup(cfg, 1 + pp, "cpu", check_data=False)


class Builds:
    """Built model parts by (path, pipeline stages or whole, dtype, float8), each built once."""

    def __init__(self) -> None:
        self.cache: dict = {}

    def parts(self, path: ModelPath, *, pp: bool, dtype: torch.dtype, float8: bool = False) -> list:
        """The whole model as one part, or every pipeline stage in stage order (the pp ranks' plans)."""
        key = (path.name, pp, dtype, float8)
        if key not in self.cache:
            cfg, setup = config(path, pp=pp, overrides=["--float8.enable", "true"] if float8 else [])
            args = setup.model_args
            if hasattr(args, "aux_loss_coeff"):
                args = dataclasses.replace(args, aux_loss_coeff=0.0)
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype)  # as the float64 reference mode builds (engine/train/trainer.py)
            try:
                stages = {}
                for rank in range(cfg.parallelism.pp):
                    plan = setup.pipeline_plan(rank)
                    built, _, _ = build_model_parts(cfg, setup.model_spec, args, pp_plan=plan, device=CPU)
                    stages.update(zip(plan.local_stages if plan else [0], built))
            finally:
                torch.set_default_dtype(previous)
            self.cache[key] = [stages[s] for s in sorted(stages)]
        return self.cache[key]

    def float8_reference(self, path: ModelPath):
        """The whole float32 model of ``path`` converted to float8 by torchao by hand (:func:`float8_reference`)."""
        key = ("torchao", path.name)
        if key not in self.cache:
            self.cache[key] = float8_reference(self.parts(path, pp=False, dtype=torch.float32)[0])
        return self.cache[key]


@dataclasses.dataclass
class PathResult:
    loss: torch.Tensor  # the step's loss (token sum / label tokens), 0-dim
    z_logged: torch.Tensor | float  # the run's ZLoss token sum
    grads: dict[str, torch.Tensor]  # canonical parameter name -> gradient (tied copies summed)


def run_path(parts: list, loss_path: str, tokens: torch.Tensor, labels: torch.Tensor, *, z_weight: float = 0.0,
             documents: bool = False) -> PathResult:
    """One step's forward and backward of LongTensor [B, S] ``tokens`` / ``labels`` on ``loss_path``:
    the whole model through ``SingleRunner.step``, or the stages as a schedule drives them."""
    pipeline, kind = loss_path.startswith(RUNNER_PATHS["PipelineRunner"]), loss_path.rsplit("/", 1)[-1]
    z_loss = ZLoss(z_weight)
    inputs = DocumentInputs(BOS, True, False) if documents else None
    context = StepContext(parts, CPU, context_parallel=None, autocast_bf16=False, loss_parallel=False,
                          documents=inputs, loss_chunk_tokens=LOSS_KINDS[kind], z_loss=z_loss)
    global_tokens = (labels != -100).sum()
    try:
        for part in parts:
            part.zero_grad(set_to_none=True)
        microbatch = context.shard(tokens, labels)
        if pipeline:
            loss = _stages_forward_backward(parts, context, *microbatch, global_tokens)
            sum_tied_gradients(parts, plan=None, pp_group=None)  # one process holds both ends
        else:
            loss = SingleRunner(parts, context).step([microbatch], global_tokens)
        grads = {}
        for part in parts:
            for name, param in part.named_parameters():
                if param.grad is not None:
                    grads.setdefault(clean_name(name), param.grad.detach().clone())
        return PathResult(loss, z_loss.take(), grads)
    finally:
        for part in parts:
            part.z_loss = None
            part.zero_grad(set_to_none=True)


def _stages_forward_backward(stages, context, inputs, labels, window, global_tokens) -> torch.Tensor:
    """What a pipeline schedule does with a microbatch (engine/train/runner.py ``PipelineRunner``):
    every stage gets the model's keyword inputs, the window inputs and, when the last stage takes
    them, the labels; the last stage's output goes through the stage loss function."""
    takes_labels, loss_fn = last_stage_loss(context)
    inputs, kwargs = context.model_inputs(inputs)
    if takes_labels:
        kwargs.update(labels=labels, loss_chunk_tokens=context.loss_chunk_tokens)
    with context.loss_and_positions():
        hidden = inputs
        for stage in stages:
            hidden = stage(hidden, **kwargs, **window)
        loss = loss_fn(hidden, labels, global_tokens=global_tokens)
        loss.backward()
    return loss.detach()


def random_batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """LongTensor [2, SEQ] tokens and next-token labels, a masked prompt (row 0) and padding (row 1)."""
    gen = torch.Generator().manual_seed(seed)
    stream = torch.randint(3, vocab, (2, SEQ + 1), generator=gen)
    labels = stream[:, 1:].clone()
    labels[0, :3] = -100
    labels[1, -4:] = -100
    return stream[:, :-1], labels


def packed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """LongTensor [2, SEQ] windows of packed documents (tests/unit/test_document_mask.py ``packed_window``):
    the tail of an earlier document, then documents of 9, 5 and 7 tokens; documents of 12, 6 and 7."""
    gen = torch.Generator().manual_seed(1)
    stream = torch.stack([packed_window([9, 5, 7], True, gen, head=4), packed_window([12, 6, 7], False, gen)])
    return stream[:, :-1], stream[:, 1:]


def oracle_objective(model, tokens, labels, *, mtp_weight: float = 0.0, z_weight: float = 0.0,
                     documents: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(token-sum objective, its z-loss term) written from the papers on the whole ``model``: per row,
    or per document run alone as its own sequence (``documents``), F.cross_entropy of the model's
    logits; + ``z_weight`` x Σ logsumexp(logits)^2 over the label tokens (PaLM, Chowdhery et al. 2022,
    Sec. 5); + ``mtp_weight`` x the mean over depths of each depth's sum, by slicing (arXiv 2412.19437
    eq. 25; tests/unit/test_deepseek_v3_mtp.py ``_reference``)."""
    total = z_total = torch.zeros((), dtype=torch.float64)
    for row in range(tokens.shape[0]):
        ids = document_ids(tokens[row:row + 1], BOS)[0] if documents else torch.zeros(tokens.shape[1])
        for doc in ids.unique().tolist():
            where = (ids == doc).nonzero().flatten()
            t, y = (x[row:row + 1, int(where[0]):int(where[-1]) + 1] for x in (tokens, labels))
            logits = model(t)
            total = total + F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
            if z_weight:
                z_total = z_total + z_weight * (torch.logsumexp(logits, -1).square() * (y != -100)).sum()
            if mtp_weight:
                _, sums, _ = mtp_reference(model, t, y)
                total = total + mtp_weight * sum(sums) / len(sums)
    return total + z_total, z_total


def oracle_gradients(model, objective: torch.Tensor) -> dict[str, torch.Tensor]:
    """Canonical name -> d objective / d parameter of the whole ``model`` (zeros where unused)."""
    named = [(clean_name(n), p) for n, p in model.named_parameters()]
    grads = torch.autograd.grad(objective, [p for _, p in named], allow_unused=True)
    return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, grads)}


def assert_gradients_close(got: dict, want: dict, rtol: float, what: str) -> None:
    """Every parameter of ``got`` (a path's gradients) within ``rtol`` of ``want``'s in norm."""
    assert got, f"{what}: no gradient at all"
    for name, grad in got.items():
        ref = want[name]
        error = (grad - ref).norm().item()
        assert error <= rtol * ref.norm().item() + 1e-30, f"{what}: {name} off by {error:.3g} of {ref.norm():.3g}"


def float8_reference(model):
    """A copy of high-precision ``model`` converted by torchao by hand: ``convert_to_float8_training``,
    tensorwise, every ``nn.Linear`` but the output head and the MoE router whose dims are multiples of 16
    (torchao/float8/README.md; ``torch._scaled_mm`` needs them)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def keep(module, fqn: str) -> bool:
        rows, cols = module.weight.shape
        return fqn != "output" and not fqn.endswith("router.gate") and rows % 16 == 0 and cols % 16 == 0

    reference = copy.deepcopy(model)
    convert_to_float8_training(reference, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=keep)
    return reference


def float8_linears(parts) -> set[str]:
    """Names of the torchao ``Float8Linear`` modules of ``parts``."""
    from torchao.float8.float8_linear import Float8Linear

    return {name for part in parts for name, m in part.named_modules() if isinstance(m, Float8Linear)}


def seeded_gradients(part, seed: int = 5) -> dict[str, torch.Tensor]:
    """Name -> a normal gradient of each parameter's shape (drawn in ``named_parameters`` order)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=gen) for name, p in part.named_parameters()}


def param_group_rules(names: list[str]) -> list[str]:
    """The rules of the param-groups check that match some of ``names`` (the whole model's)."""
    rules = ["tok_embeddings.weight lr_mult=0.5 weight_decay=0", "layers.*.attention.* lr_mult=2",
             "*.experts.* lr_mult=3 weight_decay=0.05", "mtp.* lr_mult=4", "*norm.weight lr_mult=5"]
    return [r for r in rules if any(fnmatch.fnmatchcase(n, r.split()[0]) for n in names)]
