"""scaletrain.utils.fast_exit: a command ended by run_and_exit still does everything a normal exit does that anyone
can observe: the exit status, atexit handlers, non-daemon threads finished, buffered output flushed."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import atexit, logging, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from scaletrain.utils.fast_exit import run_and_exit

log = logging.getLogger("probe")
log.addHandler(logging.FileHandler(sys.argv[2]))

def main():
    atexit.register(lambda: print("atexit ran"))
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
    # an idle pool worker: a non-daemon thread that stops only when the interpreter's exit tells it to
    pool = ThreadPoolExecutor(1)
    pool.submit(print, "pool task ran").result()
    sys.stdout.write("buffered line without a newline")
    log.warning("logged line")
    {ending}

run_and_exit(main)
"""


@pytest.mark.parametrize(
    "ending,status,stderr",
    [("return {'summary': 1}", 0, ""), ("sys.exit(3)", 3, ""), ("sys.exit('bad input')", 1, "bad input")],
)
def test_run_and_exit_keeps_what_a_normal_exit_does(tmp_path, ending, status, stderr):
    script = tmp_path / "cmd.py"
    script.write_text(textwrap.dedent(SCRIPT.replace("{ending}", ending)))
    log = tmp_path / "log.txt"
    out = subprocess.run(
        [sys.executable, str(script), "-", str(log)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == status
    assert "buffered line without a newline" in out.stdout
    assert "thread finished" in out.stdout and "pool task ran" in out.stdout
    assert out.stdout.rstrip().endswith("atexit ran")
    assert stderr in out.stderr
    assert log.read_text() == "logged line\n"


def test_an_exception_takes_the_normal_way_out(tmp_path):
    script = tmp_path / "cmd.py"
    script.write_text("from scaletrain.utils.fast_exit import run_and_exit\nrun_and_exit(lambda: 1 / 0)\n")
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 1 and "ZeroDivisionError" in out.stderr
