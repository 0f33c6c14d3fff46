"""The driver's preemption watch: the first SIGTERM / SIGUSR1 is noted (the step finishes, then a checkpoint), a
second one terminates at once, and the previous handlers come back afterwards."""

import os
import signal
import subprocess
import sys
import textwrap

from scaletrain.trainer.run.preemption import PreemptionWatch


def test_first_signal_is_noted_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionWatch() as watch:
        assert not watch.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watch.requested and watch.signal_name == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is before


def test_second_signal_terminates_at_once():
    code = textwrap.dedent(
        """
        import os, signal, time
        from scaletrain.trainer.run.preemption import PreemptionWatch
        with PreemptionWatch() as watch:
            os.kill(os.getpid(), signal.SIGTERM)
            print("noted", watch.signal_name, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            print("not reached", flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "noted SIGTERM"
    assert out.returncode == -signal.SIGTERM


def test_take_back_handles_the_signals_again_after_a_library_replaced_the_handler():
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionWatch() as watch:
        signal.signal(signal.SIGUSR1, lambda *_: None)  # what ray.init does to SIGTERM (its handler aborts)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert not watch.requested
        watch.take_back()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watch.requested and watch.signal_name == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is before
