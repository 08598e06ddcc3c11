"""TorchServe gRPC clients work unchanged: a client compiled from TorchServe's own protos talks to RingServe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import RunningServer, compile_torchserve_stubs

CLIENT_DIR = Path(__file__).parent / "torchserve_client"


@pytest.fixture(scope="module")
def torchserve_observations(server: RunningServer, tmp_path_factory: pytest.TempPathFactory) -> dict:
    gen = compile_torchserve_stubs(CLIENT_DIR, tmp_path_factory.mktemp("torchserve_stubs"))
    # A separate process: TorchServe's messages must not share a descriptor pool with the server's own copy.
    model = server.stub().GetModelInfo(__import__("ringserve.v1.generation_pb2").v1.generation_pb2.ModelInfoRequest(),
                                       timeout=10).model
    run = subprocess.run([sys.executable, str(CLIENT_DIR / "ts_client.py"), str(gen), server.address, model],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return {"model": model, **json.loads(run.stdout)}


def test_ping_reports_healthy(torchserve_observations: dict) -> None:
    assert torchserve_observations["ping"] == {"status": "Healthy"}


def test_predictions_and_stream_predictions_generate_the_same_greedy_text(torchserve_observations: dict) -> None:
    obs = torchserve_observations
    assert "Paris" in obs["prediction"]
    assert len(obs["stream_chunks"]) > 1
    assert "".join(obs["stream_chunks"]) == obs["prediction"]
    assert obs["raw_text_prediction"]  # a non-JSON body is the prompt itself


def test_stream_predictions2_answers_each_sequence_and_reports_errors_in_band(torchserve_observations: dict) -> None:
    bidi = torchserve_observations["bidi"]
    text_a = "".join(r["text"] for r in bidi if r["seq"] == "a")
    assert text_a == torchserve_observations["prediction"]
    errors_b = [r for r in bidi if r["seq"] == "b"]
    assert len(errors_b) == 1 and errors_b[0]["status"] == 3  # INVALID_ARGUMENT
    assert "max_tokens" in errors_b[0]["message"]


def test_bad_predictions_get_the_right_status_naming_the_field(torchserve_observations: dict) -> None:
    obs = torchserve_observations
    assert obs["unknown_model"].startswith("NOT_FOUND")
    assert obs["missing_data"].startswith("INVALID_ARGUMENT") and "input" in obs["missing_data"]
    assert obs["bad_temperature"].startswith("INVALID_ARGUMENT") and "temperature" in obs["bad_temperature"]


def test_management_lists_and_describes_the_served_model(torchserve_observations: dict) -> None:
    obs = torchserve_observations
    assert [m["modelName"] for m in obs["list_models"]["models"]] == [obs["model"]]
    assert obs["describe"][0]["modelName"] == obs["model"]
    assert obs["describe"][0]["workers"][0]["status"] == "READY"
    assert obs["register_missing"].startswith("INVALID_ARGUMENT") and "url" in obs["register_missing"]
    assert obs["register_remote"].startswith("INVALID_ARGUMENT") and "https" in obs["register_remote"]
    assert obs["unregister_unknown"].startswith("NOT_FOUND") and "'nope'" in obs["unregister_unknown"]
    # Nothing was left registered by the refused calls.
    assert [m["modelName"] for m in obs["list_models_after"]["models"]] == [obs["model"]]
