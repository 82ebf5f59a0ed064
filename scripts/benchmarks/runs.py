"""Work that scripts/benchmark.py runs inside (forked) rank processes: timed engine steps, counted
collectives and per-rank state bytes, and the bare PyTorch loop the engine is compared with."""

from __future__ import annotations

import os
import resource
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the bundled corpus's 0.2 MB validation split (as the tests train on): fast to tokenize, real text
SMALL_CORPUS = os.path.join(REPO, "assets", "data", "shakespeare", "validation.jsonl")


def engine_args(folder: str, overrides: dict, *, seq_len: int, local_batch_size: int) -> list[str]:
    """CLI arguments of a debugmodel run (fp32, CPU, no validation/checkpoint/TensorBoard)."""
    settings = {
        "job.dump_folder": folder, "job.print_config": "false", "job.device": "cpu",
        "data.path": SMALL_CORPUS, "training.seq_len": seq_len, "training.local_batch_size": local_batch_size,
        "training.steps": 10_000, "training.gc_freq": 0, "lr_scheduler.warmup_steps": 2,
        "validation.enable": "false", "metrics.enable_tensorboard": "false", "metrics.log_freq": 10_000,
        "metrics.time_attribution": "false", "comm.init_timeout_seconds": 120,
    }
    settings.update(overrides)
    argv: list[str] = []
    for key, value in settings.items():
        argv += [f"--{key}", str(value)]
    return argv


def build_trainer(argv: list[str]):
    from engine.config import load_config
    from engine.train.trainer import Trainer

    cfg = load_config(argv)
    cfg.validate()
    return Trainer(cfg)


def _state_bytes(trainer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients (captured before the optimizer step) and optimizer
    state: local shards for DTensors."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    params = [p for part in trainer.model_parts for p in part.parameters()]
    grads: dict[str, int] = {}

    def capture(optimizer, *_):
        grads["bytes"] = sum(local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None)

    handle = trainer.optimizer.register_step_pre_hook(capture)
    trainer.train_step()
    handle.remove()
    opt = sum(local(v).numel() * v.element_size() for state in trainer.optimizer.state.values()
              for v in state.values() if isinstance(v, torch.Tensor) and v.ndim > 0)
    return {"params": sum(local(p).numel() * p.element_size() for p in params), "grads": grads["bytes"],
            "optimizer": opt}


def timed_engine_run(argv: list[str], steps: int, warmup: int, count_comm: bool = False,
                     state_bytes: bool = False, activation_peak: bool = False) -> dict:
    """Build a Trainer, run ``warmup`` + ``steps`` steps; per-step seconds after warm-up, and
    optionally one more step's collectives (bytes per group kind), this rank's state bytes, and one
    more step's peak of activation bytes (``activation_peak``: every live tensor that is not a
    parameter, gradient, optimizer state or buffer, torch's MemTracker, tests/planner_runs.py)."""
    from parallelisms.comm_counter import CommCounter, group_names_by_mesh_dim

    trainer = build_trainer(argv)
    try:
        for _ in range(warmup):
            trainer.train_step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            trainer.train_step()
            times.append(time.perf_counter() - start)
        out = {"step_s": times, "global_tokens": trainer.global_batch_size * trainer.cfg.training.seq_len}
        if count_comm:
            dims = group_names_by_mesh_dim(trainer.parallel_dims)
            with CommCounter() as counter:
                trainer.train_step()
            comm: dict[str, int] = {}
            for record in counter.records:
                key = f"{dims.get(record.group_name, 'other')}:{record.kind}"
                comm[key] = comm.get(key, 0) + record.payload_bytes
            out["comm"] = comm
            out["param_bytes"] = sum(p.numel() * p.element_size() for part in trainer.model_parts
                                     for p in part.parameters())
            out["model_args"] = {k: getattr(trainer.model_args, k) for k in ("dim", "n_layers", "vocab_size")}
            first_block = next(iter(trainer.model_parts[0].layers.values()))
            out["block_bytes"] = sum(p.numel() * p.element_size() for p in first_block.parameters())
        if state_bytes:
            out["state"] = _state_bytes(trainer)
        if activation_peak:
            from engine.testing.memory import peak_tracker

            with peak_tracker(trainer) as tracker:
                trainer.train_step()
            out["activation_peak_bytes"] = tracker.activation_peak
        out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return out
    finally:
        trainer.close()


def engine_vs_bare_loop(argv: list[str], rounds: int, steps: int, warmup: int) -> dict:
    """One process: the engine's ``train_step`` and a bare PyTorch loop on the same model class,
    initial weights, tokens and optimizer settings, alternating blocks of ``steps`` steps."""
    import torch
    import torch.nn.functional as F

    from engine.setup.model_builder import build_meta_model, materialize
    from parallelisms.grad_norm import clip_grad_norm_

    trainer = build_trainer(argv)
    cfg = trainer.cfg
    try:
        model = materialize(build_meta_model(trainer.model_spec, trainer.model_args), torch.device("cpu"),
                            cfg.training.seed)
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optimizer.weight_decay},
             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
            lr=cfg.optimizer.lr, betas=(cfg.optimizer.beta1, cfg.optimizer.beta2), eps=cfg.optimizer.eps,
            fused=True)
        inputs, labels = trainer.dataloader.next_batch()

        def bare_step():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / labels.numel()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.training.max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()

        def block(step_fn):
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                step_fn()
                times.append(time.perf_counter() - start)
            return times

        for _ in range(warmup):
            trainer.train_step()
            bare_step()
        engine, bare = [], []
        for r in range(rounds):
            first, second = (trainer.train_step, bare_step) if r % 2 == 0 else (bare_step, trainer.train_step)
            a, b = block(first), block(second)
            engine += a if r % 2 == 0 else b
            bare += b if r % 2 == 0 else a

        # Clipping alone, on the engine model's gradients: ours vs torch's (one process).
        tparams = [p for p in trainer.model_parts[0].parameters()]
        trainer.runner.step([trainer.runner.context.shard(*trainer.dataloader.next_batch())],
                            torch.tensor(float(labels.numel())))
        ours, torchs = [], []
        for r in range(rounds * steps * 4):
            for fn, sink in ((lambda: clip_grad_norm_(tparams, 1e9), ours),
                             (lambda: torch.nn.utils.clip_grad_norm_(tparams, 1e9), torchs)):
                start = time.perf_counter()
                fn()
                sink.append(time.perf_counter() - start)
        return {"engine_s": engine, "bare_s": bare, "clip_ours_s": ours, "clip_torch_s": torchs}
    finally:
        trainer.close()


def clip_under_layout(argv: list[str], reps: int) -> dict:
    """Seconds of the engine's clip_grad_norm_ on this layout's gradients (after one forward/backward),
    and, alternating with it in the same process, of ``torch.nn.utils.clip_grad_norm_`` on plain
    full-size copies of the same gradients: the one-process clip, measured side by side."""
    import torch
    from torch.distributed.tensor import DTensor

    from parallelisms.grad_norm import clip_grad_norm_

    trainer = build_trainer(argv)
    try:
        trainer.train_step()
        microbatches = [trainer.runner.context.shard(*trainer.dataloader.next_batch())]
        tokens = trainer._dp_sum(torch.tensor(float(microbatches[0][1].numel())))
        trainer.runner.step(microbatches, tokens)
        params = [p for part in trainer.model_parts for p in part.parameters()]
        clip_grad_norm_(params, 1e9, pp_group=trainer.runner.pp_group)  # reduces pending Partial gradients
        full = []
        for p in params:
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.detach().clone()
            holder = torch.zeros_like(grad)
            holder.grad = grad
            full.append(holder)
        ours, torchs = [], []
        for _ in range(reps):
            for fn, sink in ((lambda: clip_grad_norm_(params, 1e9, pp_group=trainer.runner.pp_group), ours),
                             (lambda: torch.nn.utils.clip_grad_norm_(full, 1e9), torchs)):
                start = time.perf_counter()
                fn()
                sink.append(time.perf_counter() - start)
        return {"clip_s": ours, "torch_full_clip_s": torchs}
    finally:
        trainer.close()


def _held_unsharded_bytes(model) -> int:
    """Bytes of unsharded parameters and gradients FSDP2 holds right now on this rank (its
    ``FSDPParam`` buffers; torch-internal attributes, read for measurement only)."""
    from torch.distributed.fsdp import FSDPModule

    total = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            for buffer in getattr(fsdp_param, "all_gather_outputs", []) or []:
                total += buffer.untyped_storage().nbytes()
            grad = getattr(fsdp_param, "unsharded_accumulated_grad", None)
            if grad is not None:
                total += grad.untyped_storage().nbytes()
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None and unsharded.grad is not None:
                total += unsharded.grad.untyped_storage().nbytes()
    return total


def held_between_microbatches(argv: list[str]) -> dict:
    """FSDP's unsharded bytes held after microbatch 1 of 2, reducing after each microbatch or only
    after the last (``parallelism.grad_sync_each_microbatch``), measured on this rank."""
    import torch

    trainer = build_trainer(argv)
    try:
        trainer.train_step()  # warm-up, and the optimizer state exists
        model = trainer.model_parts[0]
        out = {}
        for mode in ("each", "last"):
            trainer.runner.sync_each_microbatch = mode == "each"
            batches = [trainer.runner.context.shard(*trainer.dataloader.next_batch()) for _ in range(2)]
            tokens = trainer._dp_sum(torch.tensor(float(sum(labels.numel() for _, labels, _ in batches))))
            with trainer.runner.accumulation(2) as before_each:
                for index, (inputs, labels, window) in enumerate(batches):
                    next(before_each)
                    trainer.runner.forward_backward(inputs, labels, tokens, window)
                    if index == 0:
                        out[mode] = _held_unsharded_bytes(model)
            trainer.optimizer.zero_grad(set_to_none=True)
        out["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        return out
    finally:
        trainer.close()
