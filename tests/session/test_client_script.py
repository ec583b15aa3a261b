"""examples/client_script.py as its reader runs it: against a server in another process, to the end,
and interrupted by Ctrl-C (SIGINT) mid-stream, which must end it with a plain KeyboardInterrupt."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from evergreen_trio.testing.subprocess_server import spawn_server

SCRIPT = Path(__file__).parents[2] / "examples" / "client_script.py"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def test_the_client_script_streams_reuses_and_cancels() -> None:
    with spawn_server() as server:
        done = subprocess.run([sys.executable, str(SCRIPT), server.address], capture_output=True, text=True,
                              timeout=120, env=ENV, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:3] == ["echo piece: 'streamed '", "echo piece: 'in '", "echo piece: 'pieces'"]
    assert "'streamed in pieces'" in lines[3]  # GENERATE read ECHO's output by reference
    assert lines[4:] == ["cancelled: True", "aborted: UNIMPLEMENTED"]


def test_ctrl_c_mid_stream_ends_the_script_with_a_plain_keyboard_interrupt() -> None:
    with spawn_server() as server:
        # As from a terminal: a suite started in the background (``cmd &``) ignores SIGINT, and its
        # children would inherit that and never see the Ctrl-C.
        script = subprocess.Popen([sys.executable, str(SCRIPT), server.address, "--forever"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            assert script.stdout is not None
            streamed = 0
            for line in script.stdout:
                streamed += line.startswith("streaming:")
                if streamed == 5:
                    break
            assert streamed == 5, "the script stopped before streaming"
            script.send_signal(signal.SIGINT)
            _, stderr = script.communicate(timeout=60)
        finally:
            if script.poll() is None:
                script.kill()
                script.wait()
    assert stderr.rstrip().splitlines()[-1] == "KeyboardInterrupt", stderr
    assert "ExceptionGroup" not in stderr and "During handling" not in stderr, stderr
    assert script.returncode in (-signal.SIGINT, 128 + signal.SIGINT), (script.returncode, stderr)
