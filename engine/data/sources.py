"""Reading documents for training, validation and tokenizer training (Hugging Face `datasets`).

A data path is either a local file (.jsonl, .json, .txt, .parquet), a local folder (every file of
those types below it, sorted by relative path), or otherwise a Hugging Face hub dataset name.
A .txt file is one document (lossless: its newlines stay inside the text). Local files are read
with datasets' packaged builders and never touch the network. Map-style datasets are prepared in
datasets' cache (HF_DATASETS_CACHE); its file locks make concurrent loads of one file by several
processes safe, and later runs reuse the prepared copy.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator


logger = logging.getLogger("quadra.data")

# File extension -> datasets packaged builder.
BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}


def looks_like_local_path(path: str) -> bool:
    """True when `path` names (or obviously means to name) a local file or folder.

    Hub names look like "owner/name", so a path is local when it exists, is absolute or explicitly
    relative ("./", "../", "~"), or ends with a supported file extension.
    """
    return (
        os.path.exists(os.path.expanduser(path))
        or path.startswith(("/", "./", "../", "~"))
        or os.path.splitext(path)[1].lower() in BUILDERS
    )


def resolve_local_files(path: str, setting: str = "data.path") -> tuple[str, list[str]]:
    """The datasets builder name and the sorted data files of a local file or folder.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: unsupported extension, a folder without data files, or mixed file types.
    """
    full = os.path.expanduser(path)
    supported = ", ".join(sorted(BUILDERS))
    if not os.path.exists(full):
        raise FileNotFoundError(
            f"{setting}={path!r} does not exist; set {setting} to a local file or folder "
            f"({supported}) or to a Hugging Face hub dataset name"
        )
    if os.path.isfile(full):
        ext = os.path.splitext(full)[1].lower()
        if ext not in BUILDERS:
            raise ValueError(
                f"{setting}={path!r} has extension {ext!r}, which is not supported; convert it to "
                f"one of {supported}"
            )
        return BUILDERS[ext], [full]
    files = []
    for root, dirs, names in os.walk(full):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # skip .cache, .git, ...
        for name in names:
            if not name.startswith(".") and os.path.splitext(name)[1].lower() in BUILDERS:
                files.append(os.path.join(root, name))
    # Sort by path relative to the folder so the document order is the same on every machine.
    files.sort(key=lambda f: os.path.relpath(f, full))
    if not files:
        raise ValueError(
            f"{setting}={path!r} is a folder without any {supported} files; put the data files "
            "there or point the setting at a file"
        )
    builders = sorted({BUILDERS[os.path.splitext(f)[1].lower()] for f in files})
    if len(builders) > 1:
        raise ValueError(
            f"{setting}={path!r} mixes file types ({', '.join(builders)}); keep one type per folder "
            "or point the setting at a single file"
        )
    return builders[0], files


@contextlib.contextmanager
def _no_download_counting():
    """Stop datasets from pinging its S3 bucket to count loads of the packaged builder.

    That HTTP HEAD (3 s timeout) runs on every load_dataset("json", ...), even of a local file;
    without network it costs seconds per load, and local data must not touch the network at all.
    """
    import datasets

    old = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    # One progress bar per rank per load only clutters the training log.
    bars_were_on = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = old
        if bars_were_on:
            datasets.utils.logging.enable_progress_bar()


def _check_columns(columns: list[str], text_column: str, path: str, setting: str, column_setting: str):
    if text_column not in columns:
        raise ValueError(
            f"{column_setting}={text_column!r} is not a column of {setting}={path!r}; "
            f"available columns: {columns}; set {column_setting} to one of them"
        )


def load_documents(
    path: str,
    *,
    text_column: str = "text",
    split: str = "train",
    streaming: bool = False,
    setting: str = "data.path",
    column_setting: str = "data.text_column",
    num_proc: int = 1,
) -> datasets.Dataset | datasets.IterableDataset:
    """Open a document collection and check that it has rows and the text column.

    Args:
        path: local file/folder or hub dataset name (see the module docstring).
        text_column: the column holding the document text.
        split: split name, used for hub datasets only (local files form one split).
        streaming: return an `IterableDataset` that reads lazily instead of a prepared `Dataset`.
        setting, column_setting: config keys named in error messages.
        num_proc: processes that download and convert a map-style dataset into datasets' Arrow
            cache (``load_dataset(num_proc=...)``; local files: at most one per file, the order of
            the rows stays that of the files). The conversion of a corpus is otherwise one process.

    Returns:
        a map-style `datasets.Dataset` or, with streaming, a `datasets.IterableDataset`.

    Raises:
        FileNotFoundError: a local-looking path that does not exist.
        ValueError: empty dataset, missing text column, unreadable files, hub load failure.
    """
    import datasets  # here, not at the top: the pre-flight uses this module's path checks only

    if looks_like_local_path(path):
        builder, files = resolve_local_files(path, setting)
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        if all(os.path.getsize(f) == 0 for f in files):
            raise ValueError(f"{setting}={path!r} is empty (0 bytes); point it at data with documents")
        if num_proc > 1 and not streaming and len(files) > 1:  # datasets splits the work by file
            kwargs["num_proc"] = min(num_proc, len(files))
        try:
            with _no_download_counting():
                ds = datasets.load_dataset(
                    builder, data_files=files, split="train", streaming=streaming, **kwargs
                )
        except StopIteration as err:  # the json builder's way of saying "no rows"
            raise ValueError(f"{setting}={path!r} has no rows; point it at data with documents") from err
        except Exception as err:  # a corrupt file: say which setting led there
            if "corresponds to no data" in str(err):  # e.g. a jsonl of blank lines
                raise ValueError(f"{setting}={path!r} has no rows; point it at data with documents") from err
            raise ValueError(
                f"{setting}={path!r} could not be read as {builder} ({type(err).__name__}: {err}); "
                "fix or replace the file"
            ) from err
    else:
        try:
            parallel = {"num_proc": num_proc} if num_proc > 1 and not streaming else {}
            ds = datasets.load_dataset(path, split=split, streaming=streaming, **parallel)
        except Exception as err:
            raise ValueError(
                f"{setting}={path!r} is not a local file or folder, so it was loaded as a Hugging "
                f"Face hub dataset (split={split!r}), which failed ({type(err).__name__}: {err}); "
                "fix the local path or the hub name/split, or check network access"
            ) from err
    if isinstance(ds, datasets.IterableDataset):
        # Streaming json may not know its schema before the first row: peek at it.
        first = next(iter(ds), None)
        if first is None:
            raise ValueError(f"{setting}={path!r} has no rows; point it at data with documents")
        _check_columns(list(first.keys()), text_column, path, setting, column_setting)
    else:
        _check_columns(list(ds.column_names), text_column, path, setting, column_setting)
        if len(ds) == 0:
            raise ValueError(f"{setting}={path!r} has no rows; point it at data with documents")
    return ds


def iter_text_batches(
    ds: datasets.Dataset | datasets.IterableDataset,
    text_column: str,
    batch_size: int = 256,
    column_setting: str = "data.text_column",
) -> Iterator[list[str]]:
    """Yield the documents' texts in dataset order, `batch_size` documents at a time.

    Raises:
        ValueError: a row whose text is not a string (e.g. null).
    """
    row = 0
    for batch in ds.select_columns([text_column]).iter(batch_size=batch_size):
        texts = batch[text_column]
        check_texts(texts, row, text_column, column_setting)
        row += len(texts)
        yield list(texts)


def check_texts(texts: list, first_row: int, text_column: str, column_setting: str = "data.text_column") -> None:
    """Raise ValueError naming the first row (counted from ``first_row``) whose text is not a string."""
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(
                f"{column_setting}={text_column!r}: row {first_row + i} holds {type(text).__name__}, "
                "not a string; clean the data or choose another column"
            )
