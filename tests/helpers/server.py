"""A real `vllm serve` subprocess for the served-mode tests (CPU, eager, tiny model)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import httpx
import pytest

from vllm_hook.testing.tiny_models import tiny_model

API_KEY = "test-key"


class Server:
    def __init__(self, port: int, proc: subprocess.Popen, log: Path):
        self.port, self.proc, self.log = port, proc, log
        self.url = f"http://127.0.0.1:{port}"

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(hook_config: dict, arch: str = "qwen2", env_extra: dict | None = None,
            model: str | None = None, served_name: str | None = None, cli_args: Sequence[str] = ()):
    """Start `vllm serve` with `hook_config` as vllm_hook's engine config; stop it after.
    `env_extra`: environment variables for the server (a soak's baseline runs it with
    VLLM_HOOK_DISABLE=1); `model` / `served_name`: another checkpoint, under another name;
    `cli_args`: more of vLLM's flags (LoRA modules)."""
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="vllm_hook_serve_")) / "server.log"
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_PLUGINS", "VLLM_HOOK_DISABLE", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
           "--model", model or tiny_model(arch), "--dtype", "float32", "--max-model-len", "512",
           *(["--served-model-name", served_name] if served_name else []),
           "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
           "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY,
           "--additional-config", json.dumps({"vllm_hook": hook_config}), *cli_args]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)   # own process group: killed as one
    srv = Server(port, proc, log)
    try:
        deadline = time.monotonic() + 300
        while True:
            if not srv.alive():
                pytest.fail(f"server exited with {proc.returncode}:\n{srv.tail()}")
            try:
                if httpx.get(f"{srv.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after 300 s:\n{srv.tail()}")
            time.sleep(1)
        yield srv
    finally:
        stop(proc, port)


def stop(proc: subprocess.Popen, port: int) -> None:
    # SIGTERM to the API server alone lets vLLM stop its engine and workers in order; then
    # anything left in the server's process group, and anything still naming its port.
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)
    subprocess.run(["pkill", "-f", "--", f"--port {port} "], check=False)
