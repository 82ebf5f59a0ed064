"""Hugging Face checkpoints (safetensors + config.json) <-> Quadra DCP checkpoints, one process.

- :func:`import_hf_model`: a folder of a model type some family's adapter reads (Llama, Mixtral) -> a
  model-only DCP checkpoint (float32, like the master weights a run saves) that any layout starts from with
  ``checkpoint.initial_load_path``; its quadra.json holds the model arguments built from
  config.json (``model.args_path`` reads them), and the tokenizer files are copied beside it. FP8
  weights with 128x128 block scales (DeepSeek-V3's published format) are dequantized on the way
  (engine/convert/hf_fp8.py).
- :func:`export_hf_model`: a DCP checkpoint (converted, or saved by a run under any layout) ->
  ``model.safetensors`` (sharded with ``model.safetensors.index.json`` above ``max_shard_bytes``),
  ``config.json`` and ``generation_config.json`` for ``transformers.AutoModelForCausalLM``; always
  unquantized (no ``quantization_config``), whatever format the model was imported from.

Names and layouts map through the family's adapter (models/<family>/hf.py, found by
engine/convert/hf_adapter.py).

Memory: import reads one tensor at a time from the memory-mapped safetensors files and DCP writes
each into its own file before the next is made (an 8B model never sits in memory). Export holds
one output shard (``max_shard_bytes``, 5 GB by default) plus one saved tensor at a time.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
import torch.distributed.checkpoint as dcp

from engine.checkpoint import files
from engine.checkpoint.files import CheckpointError
from engine.convert.hf_adapter import (args_for_weights, args_from_hf_config, generation_config, hf_config_from_args,
                                       weight_rules)
from engine.convert.hf_fp8 import DequantizedFolder, block_size_of
from engine.checkpoint.state import MODEL_KEY, quiet_single_process, saved_model_keys
from engine.convert.tools import DTYPES, check_intact, write_model_only

__all__ = ["import_hf_model", "export_hf_model", "TOKENIZER_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # buffers some older checkpoints saved
INDEX = "model.safetensors.index.json"


def _expected_shapes(name: str, args) -> dict[str, tuple[int, ...]]:
    """{FQN: shape} of the model's state dict, from a meta-device model (no memory)."""
    from engine.setup.model_builder import build_meta_model
    from models.registry import get_model_spec

    model = build_meta_model(get_model_spec(name), args)
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


class _SafetensorsFolder:
    """The tensors of a folder of ``*.safetensors`` files, read one at a time (memory-mapped)."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        self._open = safe_open
        index = os.path.join(folder, INDEX)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as fh:
                weight_map = json.load(fh)["weight_map"]
            self.file_of = {key: os.path.join(folder, name) for key, name in weight_map.items()}
        else:
            names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
            if not names:
                raise CheckpointError(f"{folder!r} holds no *.safetensors files; from-hf reads a Hugging Face "
                                      "model folder (config.json + model*.safetensors)")
            self.file_of = {}
            for name in names:
                with safe_open(os.path.join(folder, name), framework="pt") as f:
                    self.file_of.update({key: os.path.join(folder, name) for key in f.keys()})

    def meta(self, key: str) -> torch.Tensor:
        """A meta tensor of the stored shape and dtype (reads only the file's header)."""
        with self._open(self.file_of[key], framework="pt") as f:
            sliced = f.get_slice(key)
            dtype = _SAFETENSORS_DTYPES.get(sliced.get_dtype(), torch.float32)
            return torch.empty(sliced.get_shape(), dtype=dtype, device="meta")

    def get(self, key: str) -> torch.Tensor:
        with self._open(self.file_of[key], framework="pt") as f:
            return f.get_tensor(key)

    def dtypes(self) -> dict[str, str]:
        """{name: safetensors dtype string ("BF16", "F8_E4M3", ...)}, each file's header read once."""
        out = {}
        for path in sorted(set(self.file_of.values())):
            with self._open(path, framework="pt") as f:
                out.update({key: f.get_slice(key).get_dtype() for key in f.keys() if self.file_of.get(key) == path})
        return out


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def import_hf_model(hf_dir: str, checkpoint_dir: str) -> dict:
    """Convert a Hugging Face model folder into a model-only DCP checkpoint folder.

    Args:
        hf_dir: holds ``config.json`` and ``model.safetensors`` or shards with their index.
        checkpoint_dir: the folder to create (must not exist); written via ``<folder>.tmp``.

    Returns:
        {"name", "args", "tensors", "parameters", "tokenizer", "dequantized"}: the model name and arguments,
        the number of tensors and parameters written, the copied tokenizer file (or None), and the number of
        FP8 weights read through their block scales (engine/convert/hf_fp8.py; 0 for an unquantized folder).

    Raises:
        CheckpointError: no config.json, an unsupported model (see the family's models/<family>/hf.py), a missing or
            unexpected weight, a weight whose shape does not match config.json, or a quantization other than
            DeepSeek-V3's FP8 (engine/convert/hf_fp8.py).
    """
    from models.resolve import model_record, read_json

    config_path = os.path.join(hf_dir, "config.json")
    config = read_json(config_path, "from-hf needs a Hugging Face model folder with config.json and *.safetensors",
                       error_cls=CheckpointError)
    name, args = args_from_hf_config(config, config_path)
    source = DequantizedFolder(_SafetensorsFolder(hf_dir), block_size_of(config, config_path), config_path)
    args = args_for_weights(name, args, set(source.file_of))
    rules = {rule.quadra: rule for rule in weight_rules(name, args)}
    expected = _expected_shapes(name, args)
    assert set(rules) == set(expected), sorted(set(rules) ^ set(expected))  # weight_rules covers the model
    used = set()
    for fqn, rule in rules.items():
        missing = [key for key in rule.hf if key not in source.file_of]
        if missing:
            raise CheckpointError(f"{hf_dir!r} lacks weight {missing[0]!r}, which config.json's {name} model needs")
        shape = tuple(rule.to_quadra([source.meta(key) for key in rule.hf]).shape)
        if shape != expected[fqn]:
            raise CheckpointError(f"{hf_dir!r}: {rule.hf[0]!r} gives {fqn} of shape {list(shape)}, but config.json "
                                  f"implies {list(expected[fqn])}")
        used.update(rule.hf)
    unused = sorted(key for key in source.file_of if key not in used and not _IGNORED.match(key)
                    and not (args.tie_embeddings and key == "lm_head.weight"))
    if unused:
        raise CheckpointError(f"{hf_dir!r} holds weight {unused[0]!r}, which has no place in Quadra's {name} model "
                              f"({len(unused)} such weights)")

    def resolve(fqn: str) -> torch.Tensor:
        rule = rules[fqn]
        return rule.to_quadra([source.get(key) for key in rule.hf]).to(torch.float32).contiguous()

    tokenizer_files = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, n))]

    def copy_tokenizer(tmp: str) -> None:
        for file_name in tokenizer_files:
            shutil.copyfile(os.path.join(hf_dir, file_name), os.path.join(tmp, file_name))

    placeholders = {fqn: torch.empty(shape, dtype=torch.float32, device="meta") for fqn, shape in expected.items()}
    marker = {"step": 0, "source": os.path.abspath(hf_dir), "model": model_record(name, args),
              "hf_config": config, "tokenizer_files": tokenizer_files}
    write_model_only(placeholders, checkpoint_dir, marker, resolve=resolve, before_marker=copy_tokenizer)
    tokenizer = next((n for n in ("tokenizer.json", "tokenizer.model") if n in tokenizer_files), None)
    unique = {fqn: shape for fqn, shape in expected.items() if not (args.tie_embeddings and fqn == "output.weight")}
    return {"name": name, "args": args, "tensors": len(expected), "tokenizer": tokenizer,
            "parameters": sum(torch.Size(shape).numel() for shape in unique.values()),
            "dequantized": len(source.quantized)}


def _checkpoint_model(checkpoint_dir: str, marker: dict):
    """(name, args) of the model a checkpoint holds: its quadra.json's record, or else the [model]
    section of the config stored with it."""
    from models.resolve import args_from_record, base_model_args

    where = f"{checkpoint_dir}/{files.MARKER}"
    if "model" in marker:
        spec, args = args_from_record(marker["model"], where)
        return spec.name, args
    if "config" not in marker:
        raise CheckpointError(f"{where} says neither which model the checkpoint holds (\"model\") nor the config "
                              "that saved it (a from-torch folder records neither); start a run from it with "
                              "--checkpoint.initial_load_path and export one of that run's checkpoints")
    from engine.checkpoint.state import tomllib
    from engine.config.schema import ModelSection

    section = ModelSection()
    for key, value in tomllib.loads(marker["config"]).get("model", {}).items():
        setattr(section, key, value)
    spec, args, _ = base_model_args(section)
    return spec.name, args


def _tokenizer_for(checkpoint_dir: str, marker: dict) -> str | None:
    """The tokenizer file that goes with a checkpoint: copied in by from-hf, or the run's
    ``model.tokenizer_path``; None when unknown or missing."""
    for file_name in ("tokenizer.json", "tokenizer.model"):
        if file_name in marker.get("tokenizer_files", ()):
            return os.path.join(checkpoint_dir, file_name)
    if "config" in marker:
        from engine.checkpoint.state import tomllib

        path = tomllib.loads(marker["config"]).get("model", {}).get("tokenizer_path")
        if path and os.path.isfile(path):
            return path
    return None


def _special_ids(tokenizer_path: str | None, marker: dict) -> tuple[int | None, int | None]:
    """(BOS, EOS) ids for config.json: the tokenizer's (None where it has none), else those of the
    imported folder's config.json, else (None, None)."""
    from engine.data.tokenizer import Tokenizer

    if tokenizer_path is not None:
        tokenizer = Tokenizer(tokenizer_path)
        return tuple(i if i >= 0 else None for i in (tokenizer.bos_id, tokenizer.eos_id))
    hf_config = marker.get("hf_config") or {}
    return hf_config.get("bos_token_id"), hf_config.get("eos_token_id")


def parse_size(text: str) -> int:
    """Bytes of a size such as "5GB", "500MB", "2GiB" or "1000000".

    Raises:
        ValueError: not a size.
    """
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB, 500MB or a number of bytes")
    unit = (match.group(2) or "B").upper()
    power = "BKMGT".index(unit[0]) if unit != "B" else 0
    base = 1024 if "I" in unit else 1000
    return int(float(match.group(1)) * base**power)


def export_hf_model(checkpoint_dir: str, out_dir: str, dtype: str | None = None,
                    max_shard_bytes: int = 5 * 10**9) -> dict:
    """Write a DCP checkpoint's model as a Hugging Face model folder.

    Args:
        checkpoint_dir: a checkpoint folder (saved under any layout, or written by from-hf).
        out_dir: the folder to create (must not exist); written via ``<out_dir>.tmp``.
        dtype: "float32", "bfloat16" or "float16"; None keeps the saved dtype (float32).
        max_shard_bytes: above this many bytes the weights are split into
            ``model-0000i-of-0000n.safetensors`` files listed in ``model.safetensors.index.json``.

    Returns:
        {"name", "tensors", "shards", "bytes", "tokenizer", "unquantized_from"}: the last is the
        ``quantization_config`` of the folder from-hf imported the checkpoint from (written unquantized),
        or None.

    Raises:
        CheckpointError: not a DCP checkpoint, damaged (tools.check_intact), an unknown model, a model
            Hugging Face cannot express, a missing weight, or an existing ``out_dir``.
    """
    from safetensors.torch import save_file

    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if not os.path.isfile(os.path.join(checkpoint_dir, files.DCP_METADATA)):
        raise CheckpointError(f"{checkpoint_dir!r} is not a DCP checkpoint folder (no {files.DCP_METADATA})")
    if os.path.exists(out_dir):
        raise CheckpointError(f"{out_dir!r} already exists; choose a new output folder or remove it")
    check_intact(checkpoint_dir)
    marker = files.read_marker(checkpoint_dir) or {}
    name, args = _checkpoint_model(checkpoint_dir, marker)
    tokenizer_path = _tokenizer_for(checkpoint_dir, marker)
    bos, eos = _special_ids(tokenizer_path, marker)
    metadata = dcp.FileSystemReader(checkpoint_dir).read_metadata()
    saved = set(saved_model_keys(metadata))
    entries = metadata.state_dict_metadata
    rules = weight_rules(name, args)
    for fqn, shape in _expected_shapes(name, args).items():
        entry = entries.get(f"{MODEL_KEY}.{fqn}")
        if fqn not in saved or tuple(entry.size) != shape:
            raise CheckpointError(f"{checkpoint_dir!r}: weight {fqn!r} is missing or not of shape {list(shape)}, "
                                  f"which the {name} model of its {files.MARKER} has")
    config_dtype = dtype or str(entries[f"{MODEL_KEY}.tok_embeddings.weight"].properties.dtype).removeprefix("torch.")
    out_type = DTYPES.get(config_dtype, torch.float32)
    config = hf_config_from_args(name, args, dtype=config_dtype, bos_id=bos, eos_id=eos)

    outputs, shards = _shard_plan(rules, entries, args, out_type, max_shard_bytes)
    tmp = out_dir.rstrip("/") + files.TMP_SUFFIX
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file_name = "model.safetensors" if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for fqn, rule in {rule.quadra: rule for _, rule, _, _ in shard}.items():  # one saved tensor at a time
            entry = entries[f"{MODEL_KEY}.{fqn}"]
            state = {fqn: torch.empty(entry.size, dtype=entry.properties.dtype)}
            with quiet_single_process():
                dcp.load({MODEL_KEY: state}, checkpoint_id=checkpoint_dir, no_dist=True)
            converted = rule.to_hf(state.pop(fqn))
            tensors.update({key: converted[i].to(out_type).contiguous() for key, r, i, _ in shard if r is rule})
            del converted
        save_file(tensors, os.path.join(tmp, file_name), metadata={"format": "pt"})
        _readable_like_open(os.path.join(tmp, file_name))
        weight_map.update({key: file_name for key in tensors})
        del tensors
    total = sum(item[3] for item in outputs)
    if len(shards) > 1:
        _write_json(os.path.join(tmp, INDEX), {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(os.path.join(tmp, "config.json"), config)
    _write_json(os.path.join(tmp, "generation_config.json"), generation_config(config))
    copied = _copy_hf_tokenizer(tokenizer_path, tmp)
    os.replace(tmp, out_dir)
    return {"name": name, "tensors": len(outputs), "shards": len(shards), "bytes": total, "tokenizer": copied,
            "unquantized_from": (marker.get("hf_config") or {}).get("quantization_config")}


def _shard_plan(rules, entries, args, out_type, max_shard_bytes: int) -> tuple[list, list[list]]:
    """(outputs, shards): every (hf key, rule, output index, bytes) in Hugging Face's order (a tied head
    left out), and the same cut greedily into shards of at most ``max_shard_bytes``."""
    outputs = []
    for rule in rules:
        if args.tie_embeddings and rule.quadra == "output.weight":
            continue
        per_key = torch.Size(entries[f"{MODEL_KEY}.{rule.quadra}"].size).numel() // len(rule.hf)
        outputs += [(key, rule, i, per_key * out_type.itemsize) for i, key in enumerate(rule.hf)]
    shards: list[list] = [[]]
    for item in outputs:
        if shards[-1] and sum(x[3] for x in shards[-1]) + item[3] > max_shard_bytes:
            shards.append([])
        shards[-1].append(item)
    return outputs, shards


def _copy_hf_tokenizer(tokenizer_path: str | None, folder: str) -> str | None:
    """Copy a Hugging Face ``tokenizer.json`` (and the config files beside it) into ``folder``; returns
    the copied path, or None for no or a SentencePiece tokenizer."""
    if tokenizer_path is None or not tokenizer_path.endswith(".json"):
        return None
    source = os.path.dirname(os.path.abspath(tokenizer_path))
    for file_name in ("tokenizer_config.json", "special_tokens_map.json"):
        if os.path.isfile(os.path.join(source, file_name)):
            shutil.copyfile(os.path.join(source, file_name), os.path.join(folder, file_name))
    shutil.copyfile(tokenizer_path, os.path.join(folder, "tokenizer.json"))
    return tokenizer_path


def _readable_like_open(path: str) -> None:
    """Give ``path`` the mode ``open()`` would (0o666 minus the umask): safetensors writes its files
    owner-only (0o600), unreadable to the other users of a shared folder."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
