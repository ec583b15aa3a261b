"""The real llm-d latency predictor (vendored in latency_predictor_real/) as subprocesses for tests.

:func:`latency_servers` starts its training and prediction servers with uvicorn (Bayesian Ridge,
models under a temporary folder, the prediction server syncing from the training one every
second) and yields their URLs once the prediction server reports ready. Tests that use it skip
when the ``latency-predictor`` extra is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

VENDORED = Path(__file__).parent / "latency_predictor_real"
NEEDED = ("fastapi", "uvicorn", "pandas", "scipy", "sklearn", "joblib", "requests", "orjson")
MISSING = [name for name in NEEDED if importlib.util.find_spec(name) is None]
needs_predictor = pytest.mark.skipif(
    bool(MISSING), reason=f"the latency-predictor extra is not installed (missing {', '.join(MISSING)}): "
                          "pip install -e '.[latency-predictor]'")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get_json(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        doc = json.loads(reply.read())
    assert isinstance(doc, dict)
    return doc


@dataclass
class LatencyServers:
    training: str
    prediction: str

    def env(self) -> dict[str, str]:
        """The picker's environment for them (what the reference's Helm chart sets)."""
        return {"TRAINING_SERVER_URL": self.training, "PREDICTION_SERVER_URL": self.prediction,
                "LATENCY_FLUSH_INTERVAL_SEC": "1", "LATENCY_HTTP_TIMEOUT_SEC": "5"}

    log_dir: Path

    def bulk_calls(self) -> int:
        """The prediction server's answered bulk calls, from its access log."""
        text = (self.log_dir / "prediction.log").read_text(errors="replace")
        return text.count('"POST /predict/bulk/strict HTTP/1.1" 200')

    async def samples(self) -> tuple[int, int]:
        """The (TTFT, TPOT) samples the training server holds (``/data/status``: its training and
        test sets, which it splits the samples it gets between)."""
        status = await trio.to_thread.run_sync(get_json, self.training + "/data/status")
        kept, test = status["training_data"], status["test_data"]
        assert isinstance(kept, dict) and isinstance(test, dict)
        return kept["ttft_samples"] + test["ttft_samples"], kept["tpot_samples"] + test["tpot_samples"]


_MODEL_FILES = ("TTFT_MODEL", "TPOT_MODEL", "TTFT_SCALER", "TPOT_SCALER", "TTFT_GATED_MODEL", "TPOT_GATED_MODEL")


def _command(module: str, port: int) -> list[str]:
    return [sys.executable, "-m", "uvicorn", f"{module}:app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "info"]


def _logs(folder: Path) -> str:
    return "".join((folder / f"{name}.log").read_text(errors="replace")[-2000:] for name in ("training", "prediction"))


@asynccontextmanager
async def latency_servers(tmp_path: Path) -> AsyncIterator[LatencyServers]:
    """Both servers, ready (models trained on their default priors and synced); stopped after."""
    models, local = tmp_path / "models", tmp_path / "local"
    models.mkdir()
    local.mkdir()
    base = {**os.environ, "PYTHONPATH": str(VENDORED), "LATENCY_MODEL_TYPE": "bayesian_ridge"}
    training_port, prediction_port = free_port(), free_port()
    training_env = {**base, **{f"LATENCY_{k}_PATH": str(models / f"{k.lower()}.joblib") for k in _MODEL_FILES}}
    prediction_env = {**base, "TRAINING_SERVER_URL": f"http://127.0.0.1:{training_port}",
                      "MODEL_SYNC_INTERVAL_SEC": "1",
                      **{f"LOCAL_{k}_PATH": str(local / f"{k.lower()}.joblib") for k in _MODEL_FILES}}
    servers = LatencyServers(f"http://127.0.0.1:{training_port}", f"http://127.0.0.1:{prediction_port}", tmp_path)
    with (tmp_path / "training.log").open("wb") as training_log, (tmp_path / "prediction.log").open("wb") as pred_log:
        processes = [
            await trio.lowlevel.open_process(_command("training.training_server", training_port), cwd=VENDORED,
                                             env=training_env, stdout=training_log, stderr=subprocess.STDOUT),
            await trio.lowlevel.open_process(_command("prediction.prediction_server", prediction_port), cwd=VENDORED,
                                             env=prediction_env, stdout=pred_log, stderr=subprocess.STDOUT)]
        try:
            with trio.fail_after(60):
                while True:
                    try:
                        if (await trio.to_thread.run_sync(get_json, servers.prediction + "/status")).get("is_ready"):
                            break
                    except OSError:
                        pass
                    if any(process.poll() is not None for process in processes):
                        raise RuntimeError(f"a latency predictor server exited: {_logs(tmp_path)}")
                    await trio.sleep(0.2)
            yield servers
        finally:
            for process in processes:
                process.terminate()
            with trio.move_on_after(10):
                for process in processes:
                    await process.wait()
            for process in processes:
                process.kill()
