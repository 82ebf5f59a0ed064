"""Ranks that cannot speak in a hang: stopped (SIGSTOP, a debugger) or frozen so that their watchdog
thread never runs, and the hang's one line, which names them; torch-free.

A hung rank's watchdog (engine/observe/hang.py) writes its record to ``<run folder>/hangs/attempt-K/``
and waits for every rank's record before it ends its rank. A stopped process runs nothing, its
watchdog neither: it writes no record, and before issue #48 item 3 the others waited
:data:`~engine.observe.hang.RECORD_WAIT_S` for it, the agent another minute, and torchrun's shutdown 30 s
more (a stopped process does not act on SIGTERM), 2 m 38 s from the freeze to the restart for a 30 s
timeout; the line said only "no rank progressed". Now the agent (engine/launch/elastic.py), as soon as
one record is there, marks each rank of its node that is stopped (state ``T`` or ``t`` in
``/proc/<pid>/stat``) with ``rank-R.frozen`` (:func:`mark_stopped`), which the waiting ranks count as
that rank's record, so they end at once, and SIGKILLs it before they do (:func:`settle_hang`,
:func:`kill_silent`: torchrun SIGTERMs the rest as soon as one rank ends, and waits 30 s for a rank
that does not end); a rank that is not stopped but wrote nothing is killed when the others stop
waiting. :func:`hang_verdict` names those ranks and the collectives the others wait in. From the
freeze to the restarted first step: the timeout + about 1 s + the restart's start-up.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import time

from engine.observe.hang import RECORD_WAIT_S, await_records, missing_ranks, recorded_ranks

STOPPED = ("T", "t")  # /proc/<pid>/stat states of a stopped process: by a signal (T), by a tracer (t)
HANG_WAIT_S = RECORD_WAIT_S + 5.0  # from the first record on, how long the agent waits for the others
# (the ranks themselves wait RECORD_WAIT_S; a loaded machine has taken over 15 s to write them)


def proc_state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``R``, ``S``, ``D``, ``T``, ``t``, ``Z``...) from
    ``/proc/<pid>/stat``; None where it cannot be read (gone, not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def mark_stopped(folder: str, pids: dict[int, int]) -> dict[int, str]:
    """Once ``folder`` holds a hang record: write ``rank-R.frozen`` (its pid and state) for each rank
    of ``pids`` ({global rank: pid}, this node's ranks) that wrote no record and is stopped;
    -> {rank: state} of the ranks marked now. Nothing while no record is there (no hang yet)."""
    if not os.path.isdir(folder):
        return {}
    present = recorded_ranks(folder)
    if not present:
        return {}
    marked = {}
    for rank, pid in pids.items():
        state = proc_state(pid) if rank not in present else None
        if state in STOPPED:
            path = os.path.join(folder, f"rank-{rank}.frozen")
            with open(path + ".tmp", "w") as f:
                json.dump({"rank": rank, "pid": pid, "state": state, "at": time.time()}, f)
            os.replace(path + ".tmp", path)
            marked[rank] = state
    return marked


def kill_silent(folder: str, pids: dict[int, int]) -> dict[int, str]:
    """SIGKILL each rank of ``pids`` ({global rank: pid}, this node's) that wrote no record of its own:
    stopped, it would not act on torchrun's SIGTERM before torchrun's 30 s grace; frozen, neither.
    -> {rank: its state before the kill}."""
    own = set(_own_records(folder))
    killed = {}
    for rank, pid in pids.items():
        state = proc_state(pid)
        if rank in own or state in (None, "Z", "X"):
            continue
        try:
            os.kill(pid, signal.SIGKILL)  # a stopped process dies of SIGKILL without being continued
        except OSError:
            continue
        killed[rank] = state
    return killed


def settle_hang(folder: str, pids: dict[int, int], world_size: int) -> dict[int, str]:
    """The agent's part of a hang, at each monitor interval (``pids``: {global rank: pid} of this node's
    ranks): nothing before a record is in ``folder``; then :func:`mark_stopped`, and once every rank has
    a record (own or mark), or :data:`RECORD_WAIT_S` after the first (the ranks stop waiting then),
    :func:`kill_silent`. It must come before a rank that wrote ends: torchrun then SIGTERMs the rest
    and waits 30 s for any that does not end (a stopped one). -> {rank: state} marked or killed now."""
    if not os.path.isdir(folder):
        return {}
    settled = mark_stopped(folder, pids)
    first = _first_record_time(folder)
    if first is not None and (len(recorded_ranks(folder)) >= world_size or time.time() - first > RECORD_WAIT_S):
        settled.update(kill_silent(folder, pids))
    return settled


def await_hang_records(folder: str, world_size: int) -> None:
    """Wait for every rank's record (its own or a ``.frozen`` mark) until :data:`HANG_WAIT_S` after the
    first one was written: the ranks themselves give up after :data:`RECORD_WAIT_S`."""
    first = _first_record_time(folder)
    first = time.time() if first is None else first
    await_records(folder, world_size, max(0.0, first + HANG_WAIT_S - time.time()))


def _first_record_time(folder: str) -> float | None:
    """When the first rank's own record (``rank-R.txt``) in ``folder`` was written (its mtime, seconds
    since the epoch), or None: none yet, or one removed while read."""
    try:
        return min(map(os.path.getmtime, glob.glob(os.path.join(folder, "rank-*.txt"))), default=None)
    except OSError:
        return None


def hang_verdict(folder: str, world_size: int, timeout_s: float, states: dict[int, str] | None = None) -> str:
    """The one line of a hang from the records in ``folder``: the ranks that wrote none (stopped, per
    ``rank-R.frozen`` or ``states`` = {rank: /proc state} of this node's ranks; or frozen) and the
    collectives the others wait in; else who waited in which collective and who never entered it
    (:func:`~engine.observe.hang.missing_ranks`)."""
    own = _own_records(folder)
    silent = [rank for rank in range(world_size) if rank not in own]
    where = f"every rank's stack is in {folder}" if not silent else \
        f"the stacks of rank {_ranks(sorted(own))} are in {folder}" if own else f"no rank wrote its stack to {folder}"
    if not silent:
        verdict = missing_ranks(folder)
        if verdict is None:
            return f"quadra: hang: no rank progressed for {timeout_s:g} s (comm.hang_timeout_seconds); {where}"
        waiting, collective, missing = verdict
        return (f"quadra: hang: rank {_ranks(waiting)} waited over {timeout_s:g} s (comm.hang_timeout_seconds) in "
                f"{collective}, which rank {_ranks(missing)} never entered; {where}")
    states = {**(states or {}), **_marked(folder)}
    stopped = [rank for rank in silent if states.get(rank) in STOPPED]
    frozen = [rank for rank in silent if rank not in stopped]
    why = []
    if stopped:
        kinds = {"T": "SIGSTOP", "t": "a debugger"}
        how = " or ".join(sorted({kinds[states[r]] for r in stopped}))
        why.append(f"{_were(stopped)} stopped ({how}: state {'/'.join(sorted({states[r] for r in stopped}))} "
                   f"in /proc/<pid>/stat)")
    if frozen:
        why.append(f"{_were(frozen)} frozen (no record from its watchdog thread)")
    line = (f"quadra: hang: rank {_ranks(silent)} made no progress for {timeout_s:g} s "
            f"(comm.hang_timeout_seconds) and wrote no record: rank {'; rank '.join(why)}")
    waits = _waits(folder, own)
    if waits:
        line += ", so it never reached " + ", nor ".join(
            f"{what}, which rank {_ranks(ranks)} {'waits' if len(ranks) == 1 else 'wait'} in" +
            (f" at step {step}" if step is not None else "") for (what, step), ranks in waits.items())
    return f"{line}; {where}"


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


def _were(ranks: list[int]) -> str:
    return f"{_ranks(ranks)} {'was' if len(ranks) == 1 else 'were'}"


def _own_records(folder: str) -> dict[int, str]:
    """{rank: first line of its own ``rank-R.txt``}."""
    lines = {}
    for path in glob.glob(os.path.join(folder, "rank-*.txt")):
        name = os.path.basename(path)[5:-4]
        if name.isdigit():
            try:
                with open(path) as f:
                    lines[int(name)] = f.readline()
            except OSError:
                continue
    return lines


def _marked(folder: str) -> dict[int, str]:
    """{rank: state} of the ``rank-R.frozen`` marks (this node's agent or another node's)."""
    states = {}
    for path in glob.glob(os.path.join(folder, "rank-*.frozen")):
        try:
            with open(path) as f:
                mark = json.load(f)
            states[int(mark["rank"])] = str(mark["state"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return states


def _waits(folder: str, own: dict[int, str]) -> dict[tuple[str, int | None], list[int]]:
    """{(the collective, the step): ranks waiting in it}: each recorded rank's newest Flight Recorder
    entry (the operation it is blocked in) and the step its record names."""
    waits: dict[tuple[str, int | None], list[int]] = {}
    for rank in sorted(own):
        try:
            with open(os.path.join(folder, f"rank-{rank}.fr.json")) as f:
                entries = json.load(f).get("entries", [])
        except (OSError, ValueError):
            continue
        if not entries:
            continue
        entry = max(entries, key=lambda e: (int(e.get("time_created_ns", 0)), int(e.get("record_id", 0))))
        group = [str(g) for g in entry.get("process_group", ["?"])]
        name = group[-1] if group[-1] not in ("", "undefined") else group[0]
        seq = entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")
        step = re.search(r" in step (\d+) ", own[rank])
        what = f"{entry.get('profiling_name', '?')} #{seq} of process group {name}"
        waits.setdefault((what, int(step[1]) if step else None), []).append(rank)
    return waits
