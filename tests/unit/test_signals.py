"""The rank side of stop signals (engine/train/signals.py), in this process: what one and two SIGINTs do."""

from __future__ import annotations

import os
import signal
import time

import pytest

from engine.train import signals


@pytest.fixture
def installed():
    assert signals.install()
    yield
    signals.restore()


def _send(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # let the interpreter run the handler before the next signal


def test_first_signal_is_a_stop_request(installed):
    request = signals.StopRequest("cpu", distributed=False)
    assert request.agreed() is None
    _send(signal.SIGUSR1)
    _send(signal.SIGTERM)
    assert request.agreed() == "SIGUSR1"  # the first one is what the run reports


def test_second_sigint_aborts_a_rank_started_without_the_launcher(installed, monkeypatch):
    monkeypatch.delenv("QUADRA_LAUNCHER", raising=False)
    _send(signal.SIGINT)
    assert signals.StopRequest("cpu", distributed=False).agreed() == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
        _send(signal.SIGINT)


def test_under_the_launcher_only_the_launcher_counts_ctrl_c(installed, monkeypatch):
    """A Ctrl-C reaches a rank twice (from the terminal and forwarded by the launcher): still one stop."""
    monkeypatch.setenv("QUADRA_LAUNCHER", "1")
    try:
        _send(signal.SIGINT)
        _send(signal.SIGINT)
    except KeyboardInterrupt:
        pytest.fail("the second SIGINT aborted the rank; under the launcher only the launcher may")
    assert signals.StopRequest("cpu", distributed=False).agreed() == "SIGINT"


def test_restore_puts_the_previous_handlers_back():
    before = signal.getsignal(signal.SIGTERM)
    signals.install()
    assert signal.getsignal(signal.SIGTERM) is not before
    signals.restore()
    assert signal.getsignal(signal.SIGTERM) is before
