"""SIGINT and SIGTERM end every demo cleanly: exit 128+N, the JSON summary, the PNG, and no stack dump.

Each test starts a demo as a subprocess, waits until it has printed a progress line (it is training), sends
the signal and checks what the user sees. Nothing waits on time: the tests wait on output, with generous
deadlines for a busy machine.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

DUMP_MARKERS = ("Traceback", "*** SIGTERM received", "*** SIGINT received", "Stack trace", "Fatal Python error")


class Demo:
    """A demo subprocess in a session of its own, its stderr read line by line on a thread."""

    def __init__(self, *args: str) -> None:
        cmd = [sys.executable, "-m", "rollhub", "demo", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.err: list[str] = []
        self.out: list[str] = []
        self._readers = [
            threading.Thread(target=self._read_err, daemon=True),
            threading.Thread(target=self._read_out, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        self.out.extend(self.proc.stdout)

    def wait_for(self, accept: Callable[[str], bool], timeout_s: float) -> str:
        """The first stderr line that ``accept`` takes; fails if the demo ends or stays silent first."""
        while True:
            try:
                line = self.lines.get(timeout=timeout_s)
            except queue.Empty:
                pytest.fail(f"no matching progress line within {timeout_s} s; stderr so far: {''.join(self.err)}")
            if line is None:
                pytest.fail(f"the demo ended before making progress: {''.join(self.err)[-3000:]}")
            if accept(line):
                return line

    def finish(self, timeout_s: float = 180.0) -> tuple[int, str, str]:
        """Exit status, stdout and stderr once the demo has exited."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        for reader in self._readers:
            reader.join(30)
        return self.proc.returncode, "".join(self.out), "".join(self.err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture
def demos() -> list[Demo]:
    started: list[Demo] = []
    yield started
    for demo in started:
        demo.kill()


def training(label: str, min_step: int = 1) -> Callable[[str], bool]:
    """Accepts a progress line of ``label`` at trainer step ``min_step`` or later."""

    def accept(line: str) -> bool:
        if not line.startswith(f"{label} ") or "step " not in line:
            return False
        step = line.split("step ", 1)[1].split("/", 1)[0]
        return step.isdigit() and int(step) >= min_step

    return accept


def check_clean_stop(demo: Demo, sig: signal.Signals) -> dict:
    code, out, err = demo.finish()
    assert code == 128 + sig, err[-3000:]
    for marker in DUMP_MARKERS:
        assert marker not in err, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stopped_by"] == sig.name
    assert f"stopped by {sig.name}" in err.strip().splitlines()[-1]  # the progress line's final state
    assert "\r" not in err  # not a terminal: plain lines only
    return summary


def test_sigterm_stops_the_buffer_demo_with_its_summary(tmp_path: Path, demos: list[Demo]) -> None:
    demo = Demo("buffer", "--max-seconds", "600", "--summary-json", str(tmp_path / "s.json"))
    demos.append(demo)
    demo.wait_for(lambda line: line.startswith("buffer ") and "paused now" in line, 120)
    demo.proc.send_signal(signal.SIGTERM)
    summary = check_clean_stop(demo, signal.SIGTERM)
    assert summary["wall_s"] < 600 and json.loads((tmp_path / "s.json").read_text()) == summary


def test_sigint_to_the_process_group_stops_the_in_process_arithmetic_demo(tmp_path: Path, demos: list[Demo]) -> None:
    """Ctrl-C at a terminal signals the whole process group; the run ends with its summary and PNG."""
    out = tmp_path / "out"
    demo = Demo("arithmetic", "--in-process", "--n-prompts", "8", "--group-size", "4", "--out-dir", str(out))
    demos.append(demo)
    demo.wait_for(training("arithmetic", 3), 180)
    os.killpg(demo.proc.pid, signal.SIGINT)
    summary = check_clean_stop(demo, signal.SIGINT)
    assert summary["steps"] >= 3 and summary["variant"] == "in-process"
    assert (out / "arithmetic_learning_curve.png").stat().st_size > 1000


@pytest.mark.ray
def test_sigterm_stops_the_distributed_arithmetic_demo(tmp_path: Path, demos: list[Demo]) -> None:
    """The reported case: SIGTERM mid-run once printed Ray's stack dump and wrote no summary or PNG."""
    out = tmp_path / "out"
    demo = Demo("arithmetic", "--n-prompts", "8", "--group-size", "4", "--out-dir", str(out))
    demos.append(demo)
    demo.wait_for(training("arithmetic", 3), 300)
    demo.proc.send_signal(signal.SIGTERM)
    summary = check_clean_stop(demo, signal.SIGTERM)
    assert summary["steps"] >= 3 and summary["variant"] == "distributed"
    assert (out / "arithmetic_learning_curve.png").stat().st_size > 1000


@pytest.mark.ray
@pytest.mark.parametrize("backend", ["local", "ray"])  # the Ray runtime installs signal handlers of its own
def test_sigint_to_the_process_group_stops_the_cartpole_demo(tmp_path: Path, demos: list[Demo], backend: str) -> None:
    out = tmp_path / "out"
    demo = Demo(
        "cartpole", "--out-dir", str(out), "--summary-json", str(tmp_path / "s.json"),
        "--target-return", "1000", "--set", f"fleet.backend={backend!r}",  # never done before the signal
    )  # fmt: skip
    demos.append(demo)
    demo.wait_for(lambda line: line.startswith("cartpole ") and "steps " in line, 300)
    os.killpg(demo.proc.pid, signal.SIGINT)
    summary = check_clean_stop(demo, signal.SIGINT)
    assert summary["policy_version"] >= 1 and json.loads((tmp_path / "s.json").read_text()) == summary
    assert (out / "cartpole_learning_curve.png").stat().st_size > 1000


def test_sigint_while_the_vllm_engine_starts_ends_the_llm_demo_and_stops_the_engine(
    tmp_path: Path, demos: list[Demo]
) -> None:
    """An engine that never becomes ready (a stand-in interpreter that sleeps): Ctrl-C is acted on at once, not
    after the engine's start."""
    pid_file = tmp_path / "engine.pid"
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec {sys.executable} -c 'import time; time.sleep(600)'\n")
    script.chmod(0o755)
    demo = Demo("llm", "--in-process", "--out-dir", str(tmp_path / "out"), "--set", f"inference.python={str(script)!r}")
    demos.append(demo)
    demo.wait_for(lambda line: "starting vLLM engine" in line, 300)
    engine = wait_for_pid(pid_file, 120)
    os.killpg(demo.proc.pid, signal.SIGINT)
    code, _, err = demo.finish(timeout_s=120)
    assert code == 128 + signal.SIGINT, err[-3000:]
    assert "stopped while vLLM engine pid" in err and "was starting (stopped by SIGINT); nothing was trained" in err
    for marker in DUMP_MARKERS:
        assert marker not in err, err[-3000:]
    assert not psutil.pid_exists(engine) or psutil.Process(engine).status() == psutil.STATUS_ZOMBIE


def wait_for_pid(path: Path, timeout_s: float) -> int:
    """The pid a process wrote into ``path``, once it has (polled; fails after ``timeout_s``)."""
    for _ in range(int(timeout_s * 10)):
        text = path.read_text().strip() if path.exists() else ""
        if text.isdigit():
            return int(text)
        time.sleep(0.1)
    pytest.fail(f"{path} was not written within {timeout_s} s")
