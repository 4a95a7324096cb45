"""SignalStop: a stop that signal handlers set without taking a lock (mtp up's Ctrl-C, the server's drain)."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from mtp_runtime.signal_stop import SignalStop


def test_wait_times_out_unset_and_returns_at_once_when_set():
    stop = SignalStop()
    started = time.monotonic()
    assert stop.wait(0.05) is False and not stop.is_set()
    assert time.monotonic() - started >= 0.05
    assert stop.wait(0) is False
    stop.set()
    assert stop.is_set() and stop.wait(0) is True and stop.wait(10) is True and stop.wait() is True


def test_a_set_from_another_thread_wakes_a_long_wait():
    stop = SignalStop()
    threading.Timer(0.1, stop.set).start()
    started = time.monotonic()
    assert stop.wait(30) is True
    assert time.monotonic() - started < 5


def test_a_signal_wakes_a_long_wait_and_the_previous_handler_comes_back():
    stop = SignalStop()
    before = signal.getsignal(signal.SIGUSR1)
    with stop.on_signals(signal.SIGUSR1):
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        started = time.monotonic()
        assert stop.wait(30) is True
        assert time.monotonic() - started < 5
    assert signal.getsignal(signal.SIGUSR1) is before


def test_call_when_set_runs_the_callback_once_on_its_own_thread():
    stop = SignalStop()
    calls = []
    done = threading.Event()

    def callback():
        calls.append(threading.current_thread().name)
        done.set()

    watcher = stop.call_when_set(callback, name="watcher")
    time.sleep(0.05)
    assert not calls
    stop.set()
    stop.set()
    assert done.wait(5)
    watcher.join(5)
    assert calls == ["watcher"]


def test_setting_it_more_often_than_the_pipe_holds_never_blocks():
    stop = SignalStop()
    for _ in range(70_000):  # a pipe holds 64 KiB: later writes would block, or raise, were they not handled
        stop.set()
    assert stop.wait(0)


CHILD = textwrap.dedent("""
    import signal, sys
    from mtp_runtime.signal_stop import SignalStop
    with SignalStop().on_signals(signal.SIGINT) as stop:
        print("ready", flush=True)
        spins = 0
        while not stop.wait(0):  # inside wait nearly all the time: where threading.Event's set() would deadlock
            spins += 1
    print("stopped", flush=True)
""")


def test_sigint_always_stops_a_loop_that_waits_on_it():
    # threading.Event set from the handler hung on about half of these: the handler ran while the interrupted
    # wait() held the Event's lock. SignalStop takes no lock, so every one of them stops.
    hung = []
    for attempt in range(12):
        proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
            time.sleep(0.002 * attempt)
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=10)
            assert proc.returncode == 0 and out == "stopped\n", out
        except subprocess.TimeoutExpired:
            hung.append(attempt)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not hung, f"SIGINT did not stop the loop in attempts {hung}"
