"""Offline checkpoint tools, one process, no process group: export, import and seed checkpoints.

- :func:`export_model_weights`: a DCP checkpoint's model weights -> one consolidated ``torch.save``
  file ``{FQN: full tensor}`` (e.g. for evaluation or conversion to another format);
- :func:`import_model_weights`: such a file -> a model-only DCP checkpoint folder, which a run can
  start from (``checkpoint.initial_load_path``) under any layout;
- :func:`save_seed_checkpoint`: the initial weights of a config written as ``step-0`` of its
  checkpoint folder, so that runs with different parallel layouts start from the same file;
- Hugging Face safetensors + config.json in both directions: engine/convert/hf.py
  (``import_hf_model``, ``export_hf_model``), which writes through :func:`write_model_only`.

The scripts ``scripts/convert_checkpoint.py`` and ``scripts/seed_checkpoint.py`` are thin command
lines over these functions.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from engine.checkpoint import files, manifest
from engine.checkpoint.files import CheckpointError
from engine.checkpoint.state import MODEL_KEY, quiet_single_process, saved_model_keys

logger = logging.getLogger("quadra")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_model_only(weights: dict[str, torch.Tensor], folder: str, marker: dict, *, resolve=None,
                      before_marker=None) -> str:
    """Write ``{"model": weights}`` with DCP into ``folder`` (via ``folder.tmp``) with its marker,
    which holds the manifest of every file (engine/checkpoint/manifest.py).

    Args:
        resolve: None, or ``fqn -> tensor``: then ``weights`` only give shapes and dtypes (e.g. meta
            tensors) and each tensor is made by ``resolve`` just before DCP writes it, into a file
            of its own, so memory holds one tensor at a time (torch's ``SavePlanner.resolve_data``
            is the documented place for such lazy materialization).
        before_marker: None, or ``tmp_folder -> None`` adding files before the marker is written.

    Returns:
        ``folder``.

    Raises:
        CheckpointError: ``folder`` exists (never overwritten).
    """
    if os.path.exists(folder):
        raise CheckpointError(f"{folder!r} already exists; choose a new output folder or remove it")
    tmp = folder.rstrip("/") + files.TMP_SUFFIX
    if os.path.exists(tmp):  # left by a conversion that did not finish
        shutil.rmtree(tmp)
    with quiet_single_process():
        if resolve is None:
            dcp.save({MODEL_KEY: weights}, checkpoint_id=tmp, no_dist=True)
        else:
            writer = dcp.FileSystemWriter(tmp, single_file_per_rank=False)
            dcp.save({MODEL_KEY: weights}, storage_writer=writer, planner=_LazySavePlanner(resolve), no_dist=True)
    if before_marker is not None:
        before_marker(tmp)
    described = manifest.describe(tmp, manifest.checkpoint_files(tmp, files.MARKER))
    files.write_marker(tmp, {"model_only": True, **marker, manifest.KEY: described})
    files.finish(tmp, folder)
    return folder


def check_intact(checkpoint_dir: str) -> None:
    """Check every file of a checkpoint folder against the manifest in its quadra.json (sizes and
    checksums, engine/checkpoint/manifest.py); a folder without one passes.

    Raises:
        CheckpointError: a file is missing, or its size or checksum differs; names it.
    """
    entries = (files.read_marker(checkpoint_dir) or {}).get(manifest.KEY) or {}
    problem = manifest.check(checkpoint_dir, entries)
    if problem:
        raise CheckpointError(f"{checkpoint_dir!r} is damaged: {problem}. Fix: restore it from a copy, or use "
                              "another checkpoint")


class _LazySavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that each model tensor is made on demand by ``resolve``."""

    def __init__(self, resolve):
        super().__init__()
        self._resolve = resolve

    def lookup_object(self, index):
        prefix = MODEL_KEY + "."
        if index.fqn.startswith(prefix):
            return self._resolve(index.fqn[len(prefix):])
        return super().lookup_object(index)


def export_model_weights(checkpoint_dir: str, out_path: str, dtype: str | None = None) -> int:
    """Consolidate the model weights of a DCP checkpoint into one ``torch.save`` file.

    Args:
        checkpoint_dir: a checkpoint folder (``.../checkpoint/step-N``), saved under any layout.
        out_path: the file to write: a dict {FQN: full tensor}, loadable with
            ``torch.load(out_path, weights_only=True)`` and ``model.load_state_dict``.
        dtype: cast floating-point weights to this dtype ("float32", "bfloat16", "float16");
            None keeps the saved dtype (float32 master weights).

    Returns:
        The number of tensors written.

    Raises:
        CheckpointError: not a DCP checkpoint folder, damaged (see :func:`check_intact`), no model
            weights in it, an unknown dtype, or ``out_path`` exists (never overwritten).
    """
    if os.path.exists(out_path):
        raise CheckpointError(f"{out_path!r} already exists; choose a new output file or remove it")
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    weights = load_model_weights(checkpoint_dir)
    if dtype is not None:
        weights = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in weights.items()}
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    torch.save(weights, out_path)
    return len(weights)


def load_model_weights(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """The model weights of a DCP checkpoint saved under any layout, as {FQN: full tensor} in the
    saved dtype, in this process's memory (one process, no process group).

    Raises:
        CheckpointError: not a DCP checkpoint folder, damaged (see :func:`check_intact`), or no model
            weights in it.
    """
    if not os.path.isfile(os.path.join(checkpoint_dir, files.DCP_METADATA)):
        raise CheckpointError(f"{checkpoint_dir!r} is not a DCP checkpoint folder (no {files.DCP_METADATA})")
    check_intact(checkpoint_dir)
    metadata = dcp.FileSystemReader(checkpoint_dir).read_metadata()
    keys = saved_model_keys(metadata)
    if not keys:
        raise CheckpointError(f"{checkpoint_dir!r} holds no model weights (no '{MODEL_KEY}.*' keys)")
    entries = metadata.state_dict_metadata
    weights = {key: torch.empty(entries[f"{MODEL_KEY}.{key}"].size,
                                dtype=entries[f"{MODEL_KEY}.{key}"].properties.dtype) for key in keys}
    with quiet_single_process():
        dcp.load({MODEL_KEY: weights}, checkpoint_id=checkpoint_dir, no_dist=True)
    return weights


def import_model_weights(weights_path: str, checkpoint_dir: str) -> str:
    """Write the ``{FQN: tensor}`` dict of a ``torch.save`` file as a model-only DCP checkpoint.

    The result is a step-0 checkpoint folder that a run loads with
    ``checkpoint.initial_load_path = checkpoint_dir`` (or as ``<checkpoint.folder>/step-0``).

    Raises:
        CheckpointError: the file is not a ``torch.save`` file, does not hold a dict of tensors, or
            ``checkpoint_dir`` exists.
    """
    try:
        weights = torch.load(weights_path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise CheckpointError(f"{weights_path!r}: torch.load(weights_only=True) cannot read it "
                              f"({type(error).__name__}); "
                              "pass a torch.save file of {name: tensor}, e.g. one written by to-torch") from None
    if not isinstance(weights, dict) or not weights or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()):
        raise CheckpointError(f"{weights_path!r} does not hold a dict {{name: tensor}} of model weights")
    return write_model_only(weights, checkpoint_dir, {"step": 0, "source": os.path.abspath(weights_path)})


def save_seed_checkpoint(cfg) -> str:
    """Initialize the model of ``cfg`` in this process and save it as ``step-0`` of its checkpoint folder.

    Run without a process group (one process). Every layout that later starts in this run folder
    loads these weights (model only) instead of initializing its own.

    Returns:
        The written folder ``<run folder>/<checkpoint.folder>/step-0``.

    Raises:
        CheckpointError: the checkpoint folder already holds a complete checkpoint (a seed would be
            ignored in favour of it).
        ValueError: bad [model] settings (see engine/setup/preflight.py ``resolve_model_setup``).
    """
    from engine.config import config_to_toml
    from engine.setup.model_builder import build_model_parts
    from engine.setup.preflight import resolve_model_setup
    from models.resolve import model_record

    folder = os.path.join(cfg.run_folder, cfg.checkpoint.folder)
    found = files.scan(folder)
    if found.complete:
        raise CheckpointError(
            f"{folder!r} already holds checkpoints {sorted(found.complete)}; a run resumes from those, "
            "so a seed checkpoint would never be used. Fix: use a fresh job.dump_folder")
    model_setup = resolve_model_setup(cfg)
    (model,), _, _ = build_model_parts(cfg, model_setup.spec, model_setup.args, device=torch.device("cpu"))
    marker = {"step": 0, "seed": cfg.training.seed, "config": config_to_toml(cfg),
              "model": model_record(cfg.model.name, model_setup.base_args)}
    return write_model_only(get_model_state_dict(model), files.step_dir(folder, 0), marker)
