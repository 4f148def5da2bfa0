"""StopSignals in the test process itself (pytest runs tests in the main
thread, which signal handling needs)."""

from __future__ import annotations

import os
import signal
import threading
import time

from cgpud.signals import StopSignals


def test_a_signal_sent_before_the_wait_is_kept_and_sets_stop() -> None:
    before = signal.getsignal(signal.SIGTERM)
    stop = threading.Event()
    signals = StopSignals(stop)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.wait(timeout=5) is True
        assert stop.is_set() and signals.received == signal.SIGTERM
    finally:
        signals.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_delivered_to_another_thread_wakes_the_wait() -> None:
    stop, parked = threading.Event(), threading.Event()
    side = threading.Thread(target=parked.wait, daemon=True)
    side.start()
    signals = StopSignals(stop)
    try:
        assert side.ident is not None
        threading.Timer(0.1, signal.pthread_kill, (side.ident, signal.SIGINT)).start()
        started = time.monotonic()
        assert signals.wait(timeout=5) is True
        assert time.monotonic() - started < 2 and signals.received == signal.SIGINT
    finally:
        signals.close()
        parked.set()


def test_the_wait_times_out_and_sees_stop_set_by_another_thread() -> None:
    stop = threading.Event()
    signals = StopSignals(stop)
    try:
        assert signals.wait(timeout=0.05) is False
        threading.Timer(0.1, stop.set).start()
        assert signals.wait(timeout=5) is True and signals.received is None
    finally:
        signals.close()


def test_other_signals_do_not_stop() -> None:
    stop = threading.Event()
    signals = StopSignals(stop)
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals.wait(timeout=0.3) is False and not stop.is_set()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        signals.close()
