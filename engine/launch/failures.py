"""What the ranks of a failed attempt said, and which failure a restart can cure; torch-free.

Each rank that knows why it failed writes one line to ``$QUADRA_ERROR_DIR/rank<N>.err``
(engine/train/main.py). A rank whose collective lost a peer says :data:`PEER_FAILURE`: collateral,
not a cause. Used by the launcher's one-line summary (engine/launch/launcher.py) and by its agent
before a restart (engine/launch/elastic.py).

A rank that crashes (SIGABRT, SIGSEGV, ...) writes no reason; what it left is on its stderr, which the
launcher has torchrun write to ``<run log dir>/attempt_K/<local rank>/stderr.log`` (and shows as it
grows): glibc's heap-check message (``malloc(): unaligned tcache chunk detected``, ``free(): double
free detected in tcache 2``, ...) and Python's faulthandler report (``Fatal Python error: Aborted`` and
every thread's stack; enabled in every rank by engine/train/main.py). :func:`crash_report` reads them
back for the verdict.
"""

from __future__ import annotations

import glob
import os
import re
import signal

PEER_FAILURE = "stopped: another rank went away"  # what a rank reports when a collective lost a peer
GLIBC_MARKS = ("malloc(): ", "free(): ", "double free", "corrupted", "malloc_consolidate", "munmap_chunk",
               "realloc(): ", "tcache_thread_shutdown", "malloc_check", "*** stack smashing detected")
FAULT_MARK = "Fatal Python error: "  # faulthandler's first line (then the stacks of every thread)
TAIL_BYTES = 256 * 1024  # how much of the end of a rank's stderr is searched for its crash report
REPORT_LINES = 60  # at most this many lines of a crash report are kept (the stacks, innermost first)
GLIBC_LINES = 5  # glibc's lines are searched among this many lines before faulthandler's (or the file's end)


def read_reasons(error_dir: str) -> dict[int, str]:
    """{rank: its one-line reason} from ``rank<N>.err`` files (engine/train/main.py ``_fail``)."""
    messages: dict[int, str] = {}
    for path in glob.glob(os.path.join(error_dir, "rank*.err")):
        name = os.path.basename(path)
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text and name[4:-4].isdigit():
            messages[int(name[4:-4])] = text
    return messages


def crash_report(path: str | None) -> list[str]:
    """The crash report at the end of a rank's stderr file ``path``: glibc's heap-check lines, then
    faulthandler's block (``Fatal Python error: ...`` and the stacks), at most :data:`REPORT_LINES`
    lines; [] when the file is missing or holds neither.

    glibc writes its message without a newline, so faulthandler's first line may follow on the same
    line: it is split off. glibc's lines are those among the :data:`GLIBC_LINES` lines before
    faulthandler's (the file's end without it). Only the last :data:`TAIL_BYTES` of the file are read."""
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    # split off only where it follows other text: a blank line would take one of the GLIBC_LINES
    lines = re.sub(f"([^\n]){re.escape(FAULT_MARK)}", lambda m: m[1] + "\n" + FAULT_MARK, text).splitlines()
    fault = max((i for i, line in enumerate(lines) if line.startswith(FAULT_MARK)), default=None)
    glibc_end = fault if fault is not None else len(lines)
    glibc = [line.strip() for line in lines[max(0, glibc_end - GLIBC_LINES):glibc_end]
             if any(mark in line for mark in GLIBC_MARKS)]
    if fault is None:
        return glibc[:REPORT_LINES]
    sections: list[list[str]] = []  # one per thread; the crashing one ("Current thread") goes first
    section: list[str] | None = None
    # (fault + 2 alike: faulthandler ends its first line with a blank one; lstrip for rstrip alike below:
    # its header and first lines neither start nor end with blanks)
    for line in lines[fault + 1:]:
        if line.startswith(("Thread 0x", "Current thread")):
            section = [line.rstrip()]
            sections.insert(0 if line.startswith("Current") else len(sections), section)
        elif section is not None and line.strip() and not line.startswith("Extension modules:"):
            section.append(line.rstrip())
    return (glibc + [lines[fault].rstrip()] + [line for section in sections for line in section])[:REPORT_LINES]


def crash_summary(report: list[str]) -> str:
    """One phrase from :func:`crash_report`'s lines: the glibc message(s), faulthandler's first line and the
    crashing thread's innermost Python frame, e.g. ``free(): double free detected in tcache 2; Fatal Python
    error: Aborted; in f (engine/x.py:3)`` (a path under the working directory relative to it); "" for
    an empty report."""
    parts = [line for line in report if any(mark in line for mark in GLIBC_MARKS)]
    fault = next((line for line in report if line.startswith(FAULT_MARK)), None)
    if fault:
        parts.append(fault)
        current = next((i for i, line in enumerate(report) if line.startswith("Current thread")), None)
        frame = re.match(r'\s*File "(.*)", line (\d+) in (.*)', report[current + 1]) \
            if current is not None and current + 1 < len(report) else None
        if frame:
            path = os.path.relpath(frame[1]) if frame[1].startswith(os.getcwd() + os.sep) else frame[1]
            parts.append(f"in {frame[3]} ({path}:{frame[2]})")
    return "; ".join(parts)


def how_it_ended(code: int) -> str:
    """``signal SIGKILL`` for a negative exit code (a signal), else ``exit status N``."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def failure_cause(codes: dict[int, int], messages: dict[int, str], crashes: dict[int, str] | None = None) -> str:
    """One phrase naming the root cause among the failed ranks ``codes`` ({global rank: exit code}).

    A rank killed by a signal other than the SIGTERM torchrun sends survivors, or one that exited
    without a reason, is the root; a rank that only lost a peer (``PEER_FAILURE``) is collateral and
    named only when nothing else is known (a peer on another node failed first). ``crashes``:
    {global rank: :func:`crash_summary`}, appended after a colon to the root rank's phrase."""
    # (any default not starting with PEER_FAILURE alike: no reason is no lost peer)
    died = {r: c for r, c in codes.items() if not messages.get(r, "").startswith(PEER_FAILURE)
            and c != -int(signal.SIGTERM)}
    if died:
        rank = min(died)
        crash = (crashes or {}).get(rank)
        return f"rank {rank} ended with {how_it_ended(died[rank])}" + (f": {crash}" if crash else "")
    if codes:
        rank = min(codes)
        return (f"rank {rank} lost a peer (a rank on another node failed first) and ended with "
                f"{how_it_ended(codes[rank])}")
    return "the worker group failed"


def incurable(messages: dict[int, str]) -> bool:
    """Whether a rank gave its own reason (not a lost peer): a restart would fail the same way."""
    return any(not text.startswith(PEER_FAILURE) for text in messages.values())
