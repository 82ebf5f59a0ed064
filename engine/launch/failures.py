"""What the ranks of a failed attempt said, and which failure a restart can cure; torch-free.

Each rank that knows why it failed writes one line to ``$QUADRA_ERROR_DIR/rank<N>.err``
(engine/train/main.py). A rank whose collective lost a peer says :data:`PEER_FAILURE`: collateral,
not a cause. Used by the launcher's one-line summary (engine/launch/launcher.py) and by its agent
before a restart (engine/launch/elastic.py).
"""

from __future__ import annotations

import glob
import os
import signal

PEER_FAILURE = "stopped: another rank went away"  # what a rank reports when a collective lost a peer


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


def how_it_ended(code: int) -> str:
    """``signal SIGKILL`` for a negative exit code (a signal), else ``exit status N``."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def failure_cause(codes: dict[int, int], messages: dict[int, str]) -> str:
    """One phrase naming the root cause among the failed ranks ``codes`` ({global rank: exit code}).

    A rank killed by a signal other than the SIGTERM torchrun sends survivors, or one that exited
    without a reason, is the root; a rank that only lost a peer (``PEER_FAILURE``) is collateral and
    named only when nothing else is known (a peer on another node failed first)."""
    died = {r: c for r, c in codes.items() if not messages.get(r, "").startswith(PEER_FAILURE)
            and c != -int(signal.SIGTERM)}
    if died:
        rank = min(died)
        return f"rank {rank} ended with {how_it_ended(died[rank])}"
    if codes:
        rank = min(codes)
        return (f"rank {rank} lost a peer (a rank on another node failed first) and ended with "
                f"{how_it_ended(codes[rank])}")
    return "the worker group failed"


def incurable(messages: dict[int, str]) -> bool:
    """Whether a rank gave its own reason (not a lost peer): a restart would fail the same way."""
    return any(not text.startswith(PEER_FAILURE) for text in messages.values())
