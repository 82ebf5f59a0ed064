"""Set-up checks that need only the config and the world size: run once before any rank starts.

``engine.launch`` calls :func:`check_setup` in its own process, with ``world_size = NGPU × NNODES``,
before it hands over to torchrun; every rank calls the same function again at start-up (so a rank
started by plain ``torchrun`` or by a test fails the same way). Each rule lives in the component that
owns it (``ParallelDims``, the model's ``validate_parallelism_fn``, context and pipeline planning,
the data loader's batch arithmetic, the tokenizer); this module only calls them in order, cheapest
first. Nothing here or in those rules imports torch, whichever feature the config turns on
(tests/unit/test_preflight_imports.py reads every import the pre-flight can run), so one bad
setting gives one line in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
from dataclasses import dataclass

import models  # noqa: F401  (registers the built-in models; torch-free)
from engine.checkpoint.files import CheckpointError, read_marker, scan, unwritable_folder_message
from engine.checkpoint.selection import initial_load_problem
from engine.config.param_groups import group_key, parse_rules, refuse_unmatched
from engine.data.batch_sizes import resolve_batch_sizes
from engine.data.eval_tasks import parse_task_specs, read_task
from engine.data.prepared import is_prepared, open_checked, parse_mixture, tokenizer_identity
from engine.data.sources import looks_like_local_path, resolve_local_files
from engine.data.tokenizer import Tokenizer, require_bos
from engine.observe.sinks import wandb_credentials_problem
from models.registry import get_model_spec, list_model_names
from models.resolve import args_from_record, first_args_difference, long_context_warning, model_record, resolve_model
from parallelisms.checks import validate_context_parallel
from parallelisms.float8_checks import validate_float8
from parallelisms.parallel_dims import ParallelDims
from parallelisms.pipeline_plan import V_SCHEDULES, plan_model_pipeline, stage_ids_for_rank

logger = logging.getLogger("quadra")


@dataclass(frozen=True)
class SetupPlan:
    """What the checks resolved, for the caller to reuse instead of recomputing.

    Attributes:
        parallel_dims: validated degrees (``dp_shard = -1`` resolved), no mesh built.
        model_spec, model_args: the registry entry and the flavor's arguments as trained (vocabulary
            and ``max_seq_len = training.seq_len`` applied).
        model_record: the architecture before ``seq_len`` (``models.resolve.model_record``), which
            checkpoints store; model_label: its source for messages ("llama/8B").
        tokenizer_vocab_size: pieces in ``model.tokenizer_path``.
        global_batch_size, grad_accum_steps: sequences per optimizer step and microbatches per rank.
        tokenizer: the loaded ``model.tokenizer_path`` (engine/data/tokenizer.py), for the process
            to reuse: the trainer's data loaders read through it.
        pp_plans: one ``PipelinePlan`` per pp rank (empty without pipeline parallel), planned once.
        warnings: what is unusual about the model at this ``seq_len`` (one line each, printed once:
            by the launcher, or by rank 0 when started without it).
    """

    parallel_dims: object
    model_spec: object
    model_args: object
    tokenizer_vocab_size: int
    global_batch_size: int
    grad_accum_steps: int
    model_record: dict
    model_label: str
    tokenizer: object = None
    pp_plans: tuple = ()
    warnings: tuple = ()

    def pipeline_plan(self, pp_rank: int):
        """The ``PipelinePlan`` of pp rank ``pp_rank``, or None without pipeline parallel."""
        return self.pp_plans[pp_rank] if self.pp_plans else None


@dataclass(frozen=True)
class ModelSetup:
    """The model ``[model]`` and ``training.seq_len`` ask for, checked against the tokenizer.

    Attributes:
        tokenizer: the loaded ``model.tokenizer_path``; spec: the family's ``ModelSpec``;
        args: the arguments as trained; base_args: before ``seq_len`` (what checkpoints record);
        label: the source for messages ("llama/8B").
    """

    tokenizer: object
    spec: object
    args: object
    base_args: object
    label: str


def resolve_model_setup(cfg) -> ModelSetup:
    """Load the tokenizer and resolve the model (``models.resolve.resolve_model``), no layout rule.

    Raises:
        ValueError or FileNotFoundError: a bad tokenizer path or ``[model]`` setting, one line.
    """
    tokenizer = Tokenizer(cfg.model.tokenizer_path)
    spec, args, base_args, label = resolve_model(cfg.model, seq_len=cfg.training.seq_len,
                                                 tokenizer_vocab_size=tokenizer.vocab_size)
    return ModelSetup(tokenizer, spec, args, base_args, label)


def check_setup(cfg, world_size: int, device_type: str, *, check_data: bool = True) -> SetupPlan:
    """Every start-up rule that the config and ``world_size`` decide, without building anything.

    Args:
        cfg: a validated ``JobConfig``.
        world_size: number of ranks the run will have (``NGPU × NNODES`` before launch).
        device_type: "cpu" or "cuda" (some rules, e.g. async TP, depend on it).
        check_data: also check that local ``data.path`` / ``validation.path`` exist and hold data
            files of a supported type (hub dataset names are only checked by the ranks, except an
            "owner/name" whose "owner" is a local folder: a missing local path), that
            prepared folders (those paths and ``data.mixture``) are complete and made with the run's
            tokenizer (engine/data/prepared.py), and that the checkpoint folder can be written (it
            is created).

    Returns:
        a :class:`SetupPlan`.

    Raises:
        ValueError (ParallelismError, TensorParallelError, ContextParallelError,
        PipelineConfigError, ExpertParallelError, Float8ConfigError) or FileNotFoundError: one line naming the setting,
        its value and the fix.
    """
    p, t = cfg.parallelism, cfg.training
    _check_wandb(cfg)
    parallel_dims = ParallelDims.from_config(p, world_size)
    groups = cfg.fault_tolerance.group_size if cfg.fault_tolerance.enable else 1  # torchft: outer dp
    global_batch, accum = resolve_batch_sizes(t.local_batch_size, t.global_batch_size, parallel_dims.dp * groups)
    model = resolve_model_setup(cfg)
    tokenizer, vocab = model.tokenizer, model.tokenizer.vocab_size
    spec, args, base_args, label = model.spec, model.args, model.base_args, model.label
    if cfg.document_mask.enable or cfg.document_mask.restart_positions:
        require_bos(tokenizer.bos_id)
    if cfg.float8.enable or cfg.float8.fsdp_all_gather:
        validate_float8(cfg.float8, mixed_precision_param=t.mixed_precision_param,
                        dp_shard_degree=parallel_dims.dp_shard * parallel_dims.cp, tp_degree=parallel_dims.tp,
                        fused_loss=cfg.loss.chunk_tokens > 0, tied_embeddings=cfg.model.tie_embeddings)
    if spec.validate_parallelism_fn is not None:  # heads % tp, experts % ep, ...
        spec.validate_parallelism_fn(args, p, seq_len=t.seq_len, device_type=device_type,
                                     compile_enabled=cfg.compile.enable)
    if parallel_dims.cp_enabled:
        validate_context_parallel(t.seq_len, p.cp, p.tp, p.cp_load_balance, p.cp_rotate_method,
                                  compile_enabled=cfg.compile.enable)
    pp_plans = ()
    if parallel_dims.pp_enabled:
        pp_plans = _plans_of_every_rank(plan_model_pipeline(p, args, local_batch_size=t.local_batch_size, pp_rank=0),
                                        p.pp)
    if cfg.loss.mtp_weight > 0:
        _check_mtp_weight(cfg.loss.mtp_weight, spec, args, label)
    if cfg.optimizer.param_groups and spec.param_shapes is not None:
        _check_param_groups(cfg.optimizer, spec, args)
    _check_initial_load(cfg, base_args, label)
    if cfg.eval.enable:  # every task file is read and checked (the ranks tokenize them)
        for name, path in parse_task_specs(list(cfg.eval.tasks)):
            read_task(name, path, cfg.eval.limit)
    if check_data:
        _check_local_data(cfg, tokenizer)
        _check_checkpoint_folder(cfg)
    # A run past the model's max_seq_len records the length it trained at (Hugging Face exports
    # write it as max_position_embeddings); a shorter run keeps the model's own.
    recorded = dataclasses.replace(base_args, max_seq_len=max(base_args.max_seq_len, t.seq_len))
    warning = long_context_warning(base_args, t.seq_len, label)
    return SetupPlan(parallel_dims, spec, args, vocab, global_batch, accum,
                     model_record(cfg.model.name, recorded), label, tokenizer, pp_plans,
                     tuple(w for w in (warning,) if w))


def check_rank_setup(cfg, world_size: int, device_type: str, rank: int) -> SetupPlan:
    """:func:`check_setup` for a rank at start-up (no data checks: the launcher did them); rank 0
    logs the plan's warnings when no launcher printed them (a rank started by plain torchrun or a test).

    Raises:
        as :func:`check_setup`.
    """
    setup = check_setup(cfg, world_size, device_type, check_data=False)
    if rank == 0 and not os.environ.get("QUADRA_LAUNCHER"):
        for warning in setup.warnings:
            logger.warning("%s", warning)
    return setup


def _check_wandb(cfg) -> None:
    """Refuse ``metrics.enable_wandb`` without the wandb package (naming the install command), or
    without W&B credentials where its mode needs them (``engine.observe.sinks.wandb_credentials_problem``:
    ``wandb login``, ``WANDB_API_KEY`` or ``WANDB_MODE=offline``), instead of failing after step 1.
    wandb is imported only when ``enable_wandb`` is on (its settings module imports numpy, never torch).

    Raises:
        ValueError: one line naming ``metrics.enable_wandb`` and the fix.
    """
    if not cfg.metrics.enable_wandb:
        return
    if importlib.util.find_spec("wandb") is None:
        raise ValueError('metrics.enable_wandb = true needs the wandb package: pip install -e ".[wandb]" '
                         "(or set metrics.enable_wandb = false)")
    problem = wandb_credentials_problem()
    if problem:
        raise ValueError(problem)


def _check_mtp_weight(weight: float, spec, args, label: str) -> None:
    """Refuse ``loss.mtp_weight > 0`` on a model without multi-token-prediction modules (no
    ``ModelSpec.prediction_blocks``, or none in these arguments): the weight would weigh nothing.

    Raises:
        ValueError: one line naming the setting, its value, the model and the fix (the registry's
            flavors that have the modules).
    """
    if spec.prediction_blocks is not None and spec.get("prediction_blocks")(args):
        return
    with_mtp = []
    for name in list_model_names():
        other = get_model_spec(name)
        if other.prediction_blocks is not None:
            with_mtp += [f"--model.name {name} --model.flavor {flavor}" for flavor, flavor_args in
                         sorted(other.flavors.items()) if other.get("prediction_blocks")(flavor_args)]
    raise ValueError(f"loss.mtp_weight = {weight:g} but model {label} has no multi-token-prediction modules, so the "
                     f"weight would be ignored. Fix: --loss.mtp_weight 0, or a model with them "
                     f"({'; '.join(with_mtp[:2]) or 'none is registered'})")


def _plans_of_every_rank(plan, pp: int) -> tuple:
    """``plan`` (pp rank 0's) for each of the ``pp`` ranks: the same split, each rank's own stages."""
    v_style = plan.schedule_name in V_SCHEDULES
    return tuple(dataclasses.replace(plan, local_stages=stage_ids_for_rank(r, pp, plan.num_stages, v_style))
                 for r in range(pp))


def _check_initial_load(cfg, args, label: str) -> None:
    """Refuse a ``checkpoint.initial_load_path`` that holds another architecture than ``[model]``
    builds, when its quadra.json says which (converted and newer checkpoints do; for others the
    ranks compare weight shapes when loading). Skipped when the run resumes its own checkpoint."""
    path = cfg.checkpoint.initial_load_path
    if not path or not cfg.checkpoint.enable or scan(os.path.join(cfg.run_folder, cfg.checkpoint.folder)).complete:
        return
    problem = initial_load_problem(path)
    if problem:
        raise CheckpointError(problem)
    marker = read_marker(path) or {}
    c, step = cfg.checkpoint, marker.get("step")
    if (not c.initial_load_model_only and c.initial_load_lr == "continue" and not marker.get("model_only")
            and isinstance(step, int) and step >= cfg.training.steps):
        raise CheckpointError(
            f"training.steps = {cfg.training.steps} is not above the step of checkpoint.initial_load_path = "
            f"{path!r} ({step}), where the new phase continues (checkpoint.initial_load_lr = \"continue\"): nothing "
            f"would train. Fix: --training.steps N with N > {step} (the phase trains N - {step} steps), or "
            "--checkpoint.initial_load_lr restart")
    record = marker.get("model")
    if record is None:
        return
    where = f"checkpoint.initial_load_path = {path!r}"
    if record.get("name") != cfg.model.name:
        raise CheckpointError(f"{where} holds a {record.get('name')!r} model but model.name = {cfg.model.name!r}. "
                         f"Fix: --model.name {record.get('name')} --model.args_path {path}")
    _, saved = args_from_record(record, where)
    difference = first_args_difference(saved, args)
    if difference is not None:
        raise CheckpointError(f"{where} holds another model than {label} ({difference}). Fix: build the checkpoint's "
                         f"model with --model.args_path {path} (or choose the matching model.flavor)")


def _check_local_data(cfg, tokenizer) -> None:
    mixture = parse_mixture(cfg.data.mixture)
    paths = [("data.mixture", path) for path, _ in mixture] or [("data.path", cfg.data.path)]
    if cfg.validation.enable and cfg.validation.path:
        paths.append(("validation.path", cfg.validation.path))
    identity = None
    for setting, path in paths:
        if is_prepared(path):
            identity = identity or tokenizer_identity(tokenizer)
            open_checked(path, setting, identity)  # complete, same tokenizer (no token is read)
        elif setting == "data.mixture":
            raise ValueError(f"data.mixture entry {path!r} is not a prepared folder (no manifest.json); prepare "
                             "it with scripts/prepare_data.py")
        elif looks_like_local_path(path):
            resolve_local_files(path, setting)
        elif "/" in path and os.path.isdir(path.split("/", 1)[0]):
            # "owner/name" reads as a hub dataset, but an "owner" folder here means a mistyped local path.
            top = path.split("/", 1)[0]
            raise FileNotFoundError(
                f"{setting}={path!r} does not exist, though ./{top} is a local folder (run_train.sh reads relative "
                f"paths from the repo root): fix the path, or give a hub dataset whose owner is not a local folder")


def _check_param_groups(optimizer_cfg, spec, args) -> None:
    """``optimizer.param_groups`` against the model's parameter names and shapes: a rule that matches
    no parameter (a typo) and ``optimizer=muon`` on a vector are refused in one line
    (engine/config/param_groups.py)."""
    shapes = spec.get("param_shapes")(args)
    rules = parse_rules(list(optimizer_cfg.param_groups), optimizer_cfg.name)
    refuse_unmatched([s.name for s in shapes], rules)
    for s in shapes:
        group_key(s.name, len(s.shape), rules, optimizer_cfg.name)


def _check_checkpoint_folder(cfg) -> None:
    if cfg.checkpoint.enable:
        problem = unwritable_folder_message(cfg.checkpoint.folder, os.path.join(cfg.run_folder, cfg.checkpoint.folder),
                                            keep=False)  # a dry run leaves no folders behind
        if problem:
            raise ValueError(problem)


def hardware_warnings(cfg, device_type: str) -> list[str]:
    """Settings that work but are unusual on this machine (warned about once, never refused).

    - bf16 mixed precision on a CPU without AVX512-BF16 or AMX: torch falls back to a generic GEMM.
      Measured on a 2-core AVX2 machine with torch 2.13, a bf16 matmul ran about 80× slower than
      fp32 and a whole training step of the debug model 7–11× slower.
    - Muon's Newton–Schulz in bf16 (``optimizer.muon_ns_dtype``, bf16 by default as torch.optim.Muon)
      on such a CPU: a Muon step of the debug model measured 19× an AdamW step there, 1.4× with the
      iteration in fp32 (scripts/benchmarks/optimizers.py).
    """
    warnings = []
    t = cfg.training
    if device_type == "cpu" and t.mixed_precision_param == "bfloat16" and not cpu_has_fast_bf16():
        warnings.append(
            f"training.mixed_precision_param = \"{t.mixed_precision_param}\" on a CPU without AVX512-BF16 "
            "or AMX: torch runs bf16 matmuls with a fallback kernel (measured 7-11x slower per training "
            "step than fp32 on such a CPU); set training.mixed_precision_param = \"float32\" for CPU runs"
        )
    o = cfg.optimizer
    if device_type == "cpu" and o.name == "Muon" and o.muon_ns_dtype == "bfloat16" and not cpu_has_fast_bf16():
        warnings.append(
            "optimizer.muon_ns_dtype = \"bfloat16\" on a CPU without AVX512-BF16 or AMX: Newton-Schulz runs its "
            "bf16 matmuls with a fallback kernel (a Muon step measured ~20x an AdamW step on such a CPU, 1.4x "
            "in fp32); set optimizer.muon_ns_dtype = \"float32\" for CPU runs"
        )
    return warnings


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU has native bf16 matrix instructions (x86 ``avx512_bf16`` or ``amx_bf16``,
    from /proc/cpuinfo; Arm ``bf16``). Unknown platforms count as fast (no warning)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set()
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags.update(line.split(":", 1)[1].split())
    except OSError:
        return True
    if not flags:
        return True
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
