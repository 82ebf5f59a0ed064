"""The fenced code blocks of the project's markdown pages (README.md, docs/**/*.md, engine/docs/*.md), and
the shell commands among their lines, for tests/integration/test_doc_commands.py.

A line of a shell block is a command when it starts (after an optional ``$ `` prompt and ``NAME=value``
environment assignments) with a path to run (``./run_train.sh``, ``scripts/stress.sh``) or a program name
(``python``, ``bash``, ``for`` ...); a command ending in a backslash goes on on the next line. Every other
line is output: logs, tables, layout trees. TOML and YAML blocks hold no commands.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The pages whose blocks are checked: the README and whatever docs/ pages exist (issue #49 splits the README).
PAGE_PATTERNS = ("README.md", "docs/**/*.md", "engine/docs/*.md")

_FENCE = re.compile(r"^\s*(```|~~~)\s*([\w+-]*)")
_PROGRAMS = ("python", "python3", "bash", "sh", "sbatch", "srun", "torchrun", "pip", "pip3", "uv", "git", "cd",
             "grep", "for", "while", "export", "cat", "kill", "pytest", "tail", "ls", "rm", "cp", "mv", "curl",
             "wget", "hf", "huggingface-cli", "torchft_lighthouse", "tensorboard", "wandb", "nvidia-smi", "make",
             "docker", "source", "scancel", "squeue", "env", "time", "timeout", "mkdir", "tar")
_ASSIGNMENTS = r"(?:[A-Z_][A-Z0-9_]*=\S*\s+)"
_COMMAND = re.compile(r"^(?:" + _ASSIGNMENTS + r"+\\$|" + _ASSIGNMENTS + r"*(?:\./\S|scripts/\S|(?:" + "|".join(
    re.escape(p) for p in _PROGRAMS) + r")(?:\s|$)))")
SHELL_LANGS = ("", "bash", "sh", "shell", "console", "text")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block: ``page`` (path relative to the repo), ``line`` (1-based line of its first content
    line), ``lang`` (the fence's info string, '' when none) and ``text`` (its content lines)."""

    page: str
    line: int
    lang: str
    text: str


@dataclasses.dataclass(frozen=True)
class Command:
    """A shell command of a block: ``text`` as written (its physical lines joined by newlines, a leading
    ``$ `` prompt removed), ``key`` (:func:`command_key`), and where it is (``page``, ``line``)."""

    page: str
    line: int
    text: str
    key: str


def pages(root: str = REPO) -> list[str]:
    """The markdown pages that exist under ``root``, relative paths, sorted and without repeats."""
    found = set()
    for pattern in PAGE_PATTERNS:
        found.update(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, pattern), recursive=True))
    return sorted(found)


def blocks(page: str, root: str = REPO) -> list[Block]:
    """The fenced blocks of one page, in order.

    Raises:
        AssertionError: a fence opened and never closed (the rest of the page would read as code).
    """
    with open(os.path.join(root, page), encoding="utf-8") as f:
        lines = f.read().split("\n")
    out, opened, lang, body = [], None, "", []
    for number, line in enumerate(lines, 1):
        match = _FENCE.match(line)
        if opened is None and match:
            opened, lang, body = (number + 1, match.group(1)), match.group(2).lower(), []
        elif opened is not None and line.strip().startswith(opened[1]):
            out.append(Block(page, opened[0], lang, "\n".join(body)))
            opened = None
        elif opened is not None:
            body.append(line)
    assert opened is None, f"{page}:{opened[0] - 1}: a code fence is never closed"
    return out


def is_command(line: str) -> bool:
    """Whether a line (its ``$ `` prompt removed, the block dedented) starts a shell command: see the module
    docstring. An indented line is not one (a diagram's ``   python -m engine.train``)."""
    return bool(_COMMAND.match(line.rstrip()))


def commands(block: Block) -> list[Command]:
    """The shell commands of a shell block (none for TOML, YAML and other languages)."""
    if block.lang not in SHELL_LANGS:
        return []
    out, current, start = [], None, 0
    for offset, line in enumerate(textwrap.dedent(block.text).split("\n")):
        if current is None:
            bare = line[2:] if line.startswith("$ ") else line
            if not is_command(bare):
                continue
            current, start = [bare], block.line + offset
        else:
            current.append(line)
        if not line.rstrip().endswith("\\"):
            text = "\n".join(current)
            out.append(Command(block.page, start, text, command_key(text)))
            current = None
    if current is not None:  # a backslash on the block's last line
        text = "\n".join(current)
        out.append(Command(block.page, start, text, command_key(text)))
    return out


def command_key(text: str) -> str:
    """A command's identity in the tables: its comments removed (a ``#`` after whitespace, outside quotes),
    continuation lines joined, runs of whitespace made one space. The command runs as written, not as keyed."""
    kept, quote, in_comment = [], None, False
    for i, ch in enumerate(text):
        if in_comment:
            if ch == "\n":
                in_comment = False
                kept.append(ch)
            continue
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            in_comment = True
            continue
        kept.append(ch)
    return " ".join("".join(kept).replace("\\\n", " ").split())


def all_blocks(root: str = REPO) -> list[Block]:
    """Every fenced block of every page, page by page."""
    return [block for page in pages(root) for block in blocks(page, root)]
