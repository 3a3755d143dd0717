"""rollhub's engine launcher (``python -m rollhub_vllm_serve``), run over a stand-in for vLLM: the server module
runs with the launcher's arguments, and a process the server spawns, as vLLM spawns its engine core and model
workers, has its queue reader's busy-wait capped as the launcher's own process has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rollhub.inference.engine import ENGINE_SIDE, REPACK_ENV, SERVE_MODULE, SPIN_ENV, EngineSpec

FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/device_communicators/__init__.py": "",
    # the class whose wait the worker extension caps (vLLM's shared-memory queue reader)
    "vllm/distributed/device_communicators/shm_broadcast.py": "class SpinCondition:\n    def wait(self): ...\n",
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/layers/__init__.py": "",
    # the function the worker extension wraps to keep pack sources (in the model workers only)
    "vllm/model_executor/layers/utils.py": "def dispatch_cpu_unquantized_gemm(layer, remove_weight): ...\n",
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/openai/__init__.py": "",
    # the server: reports its arguments and its own cap, then spawns a child as vLLM spawns its engine core
    "vllm/entrypoints/openai/api_server.py": """
import json, multiprocessing, sys
from vllm import child

if __name__ == "__main__":
    out = sys.argv[-1]
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=child.report, args=(out + ".child",))
    proc.start()
    proc.join(120)
    with open(out, "w") as f:
        json.dump({"argv": sys.argv[1:], "cap": child.cap(), "packs": child.packs(), "child_exit": proc.exitcode}, f)
""",
    "vllm/child.py": """
import json

def cap():
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    return getattr(SpinCondition.wait, "_rollhub_spin_s", None)

def packs():
    import sys
    from vllm.model_executor.layers import utils
    return hasattr(utils.dispatch_cpu_unquantized_gemm, "_rollhub_original") or "torch" in sys.modules

def report(path):
    with open(path, "w") as f:
        json.dump({"cap": cap(), "packs": packs()}, f)
""",
}


def _fake_vllm(root: Path) -> Path:
    for name, text in FAKE_VLLM.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _serve(tmp_path: Path, spin: str | None) -> tuple[dict, dict]:
    out = tmp_path / "server.json"
    env = {k: v for k, v in os.environ.items() if k != SPIN_ENV}
    env[REPACK_ENV] = "1"  # as rollhub starts its engines: the model workers keep their pack sources
    env["PYTHONPATH"] = os.pathsep.join([str(ENGINE_SIDE), str(_fake_vllm(tmp_path / "fake"))])
    if spin is not None:
        env[SPIN_ENV] = spin
    command = [sys.executable, "-m", SERVE_MODULE, "--model", "m", str(out)]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text()), json.loads((tmp_path / "server.json.child").read_text())


def test_the_launcher_runs_the_server_and_caps_the_processes_it_spawns(tmp_path: Path) -> None:
    server, child = _serve(tmp_path, "0.005")
    assert server["argv"] == ["--model", "m", str(tmp_path / "server.json")]
    assert server["child_exit"] == 0
    assert server["cap"] == 0.005
    assert child["cap"] == 0.005  # the spawned process ran the launcher's import, not only the server's


def test_the_launcher_leaves_the_model_workers_settings_to_the_worker_extension(tmp_path: Path) -> None:
    server, child = _serve(tmp_path, "0.005")
    # neither the server nor the engine core wraps vLLM's packing (nor imports torch for it): nothing is packed there
    assert server["packs"] is False and child["packs"] is False


def test_without_the_setting_the_launcher_leaves_vllms_own_wait(tmp_path: Path) -> None:
    server, child = _serve(tmp_path, None)
    assert server["cap"] is None and child["cap"] is None


def test_every_engine_rollhub_starts_runs_through_the_launcher() -> None:
    command = EngineSpec(model="m").command("python", 8000)
    assert command[:3] == ["python", "-m", SERVE_MODULE]
    assert (ENGINE_SIDE / f"{SERVE_MODULE}.py").is_file()
