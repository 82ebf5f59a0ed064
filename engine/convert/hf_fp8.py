"""FP8 checkpoints as DeepSeek publishes them, read as unquantized weights.

The format (README_WEIGHTS.md of deepseek-ai/DeepSeek-V3, "FP8 Weight Documentation"; transformers'
"fine-grained FP8", ``FineGrainedFP8Config``): config.json carries ``"quantization_config":
{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}``
(DeepSeek-V3.1 adds ``"scale_fmt": "ue8m0"``: scales that are powers of two, stored as float32 all the
same); each quantized weight ``W`` [rows, cols] is stored as ``float8_e4m3fn`` with a float32
``W_scale_inv`` [ceil(rows/128), ceil(cols/128)], one scale per 128x128 block, the blocks at the right
and bottom edges cut short (quantized zero-padded, the padding dropped). DeepSeek-V3 quantizes every
projection of attention and of the MLPs (dense, shared and routed experts); the embedding, output head,
norms, router and routing bias stay bf16. The value of element (i, j) is ``float(W[i, j]) *
W_scale_inv[i // 128, j // 128]``, in float32 (DeepSeek-V3's ``inference/kernel.py`` ``weight_dequant``,
whose ``fp8_cast_bf16.py`` then rounds it to bf16; here it stays float32, the dtype every import writes).

:class:`DequantizedFolder` wraps a folder of safetensors so that engine/convert/hf.py sees only plain
weights: the scales are no weights of their own, and ``get`` returns the dequantized float32 tensor.
Anything else (another ``quant_method``, ``fmt``, block size or activation scheme, FP8 weights without
a ``quantization_config``, a weight without its scale, a scale grid of the wrong shape) is refused in
one line (:class:`engine.checkpoint.files.CheckpointError`) naming the setting, its value and the fix.
"""

from __future__ import annotations

import torch

from engine.checkpoint.files import CheckpointError

__all__ = ["BLOCK", "SCALE_SUFFIX", "block_size_of", "dequantize", "DequantizedFolder"]

BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
_FIX = ("Fix: import a bf16 copy (DeepSeek-V3's inference/fp8_cast_bf16.py, or transformers' "
        "FineGrainedFP8Config(dequantize=True) then save_pretrained) with quantization_config removed")
_EXPECTED = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


def block_size_of(config: dict, where: str) -> tuple[int, int] | None:
    """The weight block size of config.json's ``quantization_config``; None when it has none.

    Raises:
        CheckpointError: a setting other than DeepSeek-V3's FP8 format (quant_method "fp8", fmt "e4m3"
            where given, activation_scheme "dynamic", weight_block_size [128, 128], scale_fmt absent or
            "ue8m0"), naming the setting, its value and the fix.
    """
    quant = config.get("quantization_config")
    if quant is None:
        return None
    for key, want in _EXPECTED.items():
        value = quant.get(key, want if key != "quant_method" else None)
        if value != want:
            _refuse(where, f"quantization_config.{key} = {value!r}; from-hf reads only {key} {want!r} (DeepSeek-V3's "
                           "FP8 weights with 128x128 block scales)")
    block = quant.get("weight_block_size")
    if not isinstance(block, (list, tuple)) or [int(b) for b in block] != list(BLOCK):
        _refuse(where, f"quantization_config.weight_block_size = {block!r}; from-hf reads only [128, 128] "
                       "(DeepSeek-V3's block scales)")
    if quant.get("scale_fmt") not in (None, "ue8m0"):
        _refuse(where, f"quantization_config.scale_fmt = {quant['scale_fmt']!r}; from-hf reads float32 scales "
                       "(scale_fmt absent or \"ue8m0\")")
    return BLOCK


def _refuse(where: str, message: str):
    raise CheckpointError(f"{where}: {message}. {_FIX}")


def dequantize(weight, scale_inv, block: tuple[int, int] = BLOCK):
    """The float32 weight of an FP8 ``weight`` [rows, cols] and its float32 ``scale_inv``
    [ceil(rows/b0), ceil(cols/b1)]: element (i, j) times the scale of block (i // b0, j // b1); the
    edge blocks cut short. Memory: the float32 result and the scales repeated per row [rows, ceil(cols/b1)].

    Raises:
        ValueError: shapes that do not fit together (the callers check them first).
    """
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"scale_inv of shape {list(scale_inv.shape)} for a weight {[rows, cols]}; want {list(grid)}")
    out = weight.to(torch.float32)
    per_row = scale_inv.to(torch.float32).repeat_interleave(block[0], dim=0)[:rows]  # [rows, grid[1]]
    for j in range(grid[1]):
        out[:, j * block[1]:(j + 1) * block[1]].mul_(per_row[:, j:j + 1])
    return out


class DequantizedFolder:
    """A folder's tensors with the FP8 ones dequantized and their scales hidden.

    ``source`` has ``file_of`` ({name: file}), ``dtypes()`` ({name: safetensors dtype string, e.g.
    "F8_E4M3"}), ``meta(name)`` and ``get(name)`` (engine/convert/hf.py's ``_SafetensorsFolder``).
    This gives the same, with ``file_of`` without the scales, ``meta`` of a quantized weight float32
    and ``get`` of it dequantized (float32). ``quantized``: the names of the FP8 weights.

    Raises:
        CheckpointError: (on construction, reading only the headers) FP8 weights or scales without a
            ``quantization_config``, an FP8 weight without its scale, a scale without its FP8 weight,
            a weight of another FP8 format, a scale not float32 or of the wrong grid shape.
    """

    def __init__(self, source, block: tuple[int, int] | None, where: str):
        dtypes = source.dtypes()
        fp8 = sorted(name for name, dtype in dtypes.items() if dtype.startswith("F8_"))
        scales = sorted(name for name in dtypes if name.endswith(SCALE_SUFFIX))
        if block is None:
            if fp8 or scales:
                name = (fp8 or scales)[0]
                raise CheckpointError(f"{where} has no quantization_config, but the checkpoint holds {name!r} "
                                      f"({dtypes[name]}); add DeepSeek-V3's \"quantization_config\": {{\"quant_method\""
                                      ": \"fp8\", \"fmt\": \"e4m3\", \"weight_block_size\": [128, 128]}} if the "
                                      "weights are in its FP8 format")
        for name in fp8:
            if dtypes[name] != "F8_E4M3":
                raise CheckpointError(f"{where}: weight {name!r} is {dtypes[name]}; quantization_config fmt \"e4m3\" "
                                      "means F8_E4M3 (torch.float8_e4m3fn)")
            if name + SCALE_SUFFIX not in dtypes:
                raise CheckpointError(f"{where}: FP8 weight {name!r} has no {name + SCALE_SUFFIX!r}; without its "
                                      "block scales it cannot be read")
        for scale in scales:
            weight = scale.removesuffix(SCALE_SUFFIX)
            if dtypes.get(weight) != "F8_E4M3":
                raise CheckpointError(f"{where}: {scale!r} scales {weight!r}, which is "
                                      f"{dtypes.get(weight, 'not in the checkpoint')}, not F8_E4M3")
            if dtypes[scale] != "F32":
                raise CheckpointError(f"{where}: {scale!r} is {dtypes[scale]}; from-hf reads float32 (F32) scales")
        self._source, self._block, self._where = source, block, where
        self.quantized = frozenset(fp8)
        self.file_of = {name: file for name, file in source.file_of.items() if name not in set(scales)}

    def meta(self, name: str):
        """A meta tensor of the weight's shape; float32 for a quantized one, whose scale grid is checked.

        Raises:
            CheckpointError: a quantized weight not 2-D or whose scale grid is not [ceil(rows/128),
                ceil(cols/128)].
        """
        stored = self._source.meta(name)
        if name not in self.quantized:
            return stored
        scale = tuple(self._source.meta(name + SCALE_SUFFIX).shape)
        grid = tuple(-(-n // b) for n, b in zip(stored.shape, self._block))
        if stored.dim() != 2 or scale != grid:
            raise CheckpointError(f"{self._where}: {name + SCALE_SUFFIX!r} has shape {list(scale)} for a weight of "
                                  f"shape {list(stored.shape)}; 128x128 blocks need {list(grid)}")
        return torch.empty(stored.shape, dtype=torch.float32, device="meta")

    def get(self, name: str):
        """The stored tensor, dequantized to float32 when it is FP8 (:func:`dequantize`)."""
        tensor = self._source.get(name)
        if name not in self.quantized:
            return tensor
        return dequantize(tensor, self._source.get(name + SCALE_SUFFIX), self._block)
