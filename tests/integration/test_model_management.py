"""Multi-model serving, TorchServe-style: models from --models-config at start-up, then RegisterModel, ScaleWorker,
SetDefault, DescribeModel and UnregisterModel at run time from a client compiled from TorchServe's own protos;
per-model health, NOT_FOUND for models that are not served, and no engine process or segment left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ringserve.v1 import generation_pb2 as pb
from server_harness import RunningServer, compile_torchserve_stubs, start_server

CLIENT = Path(__file__).parent / "torchserve_client" / "ts_manage.py"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_torchserve_stubs(CLIENT.parent, tmp_path_factory.mktemp("torchserve_stubs"))


@pytest.fixture(scope="module")
def fleet(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server started from a models config: `small` (one replica) and `pair` (two replicas, the default)."""
    work = tmp_path_factory.mktemp("fleet")
    config = work / "models.toml"
    config.write_text(
        'default_model = "pair"\n'
        f'[[models]]\nname = "small"\nmodel = "{model_path}"\nmax_model_len = 512\nnum_kv_blocks = 64\n'
        f'[[models]]\nname = "pair"\nmodel = "{model_path}"\ndata_parallel_size = 2\nnum_kv_blocks = 128\n'
    )
    server = start_server(model_path, work, "--models-config", str(config), "--max-num-seqs", "16",
                          "--max-num-batched-tokens", "256", ready_timeout_s=300)  # fmt: skip
    with server:
        yield server
        code = server.stop()
    assert code == 0, server.log()
    # Every engine and worker is gone, and so is every shared-memory segment of this server.
    leftovers = [p for p in Path("/dev/shm").glob(f"ringserve-{server.proc.pid}-*")]
    assert not leftovers, leftovers


def ts(stubs: Path, server: RunningServer, *args: str) -> dict[str, Any]:
    run = subprocess.run([sys.executable, str(CLIENT), str(stubs), server.address, *args], capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def health(server: RunningServer, service: str) -> int:
    with server.channel() as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=10).status
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND
            return health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


def engines(server: RunningServer) -> int:
    children = psutil.Process(server.proc.pid).children()
    return sum("ringserve.backend.engine_main" in " ".join(c.cmdline()) for c in children)


def greedy(server: RunningServer, model: str) -> list[int]:
    request = pb.GenerateRequest(model=model, text=PROMPT,
                                 sampling=pb.SamplingParams(max_tokens=8, temperature=0.0))  # fmt: skip
    return [t for r in server.stub().Generate(request, timeout=120) for t in r.token_ids]


def test_models_config_serves_every_model_with_its_replicas_and_default(fleet: RunningServer, stubs: Path) -> None:
    listed = fleet.stub().ListModels(pb.ListModelsRequest(), timeout=10)
    assert [m.model for m in listed.models] == ["small", "pair"] and listed.default_model == "pair"
    assert all(m.state == pb.MODEL_STATE_READY for m in listed.models)
    small = fleet.stub().GetModelInfo(pb.ModelInfoRequest(model="small"), timeout=10)
    assert small.context_length == 512 and small.kv_capacity_tokens == 64 * small.block_size
    assert engines(fleet) == 3
    pair = ts(stubs, fleet, "describe", "pair")["ok"][0]
    assert [w["status"] for w in pair["workers"]] == ["READY", "READY"] and pair["isDefault"]
    # The same weights answer the same greedy tokens, whichever model name (and replica) serves them.
    assert greedy(fleet, "small") == greedy(fleet, "pair") == greedy(fleet, "")
    for name in ("", "small", "pair"):
        assert health(fleet, name) == health_pb2.HealthCheckResponse.SERVING, name
    with pytest.raises(grpc.RpcError) as missing:
        greedy(fleet, "absent")
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND and "'small', 'pair'" in missing.value.details()


def test_register_scale_set_default_and_unregister_at_run_time(fleet: RunningServer, stubs: Path,
                                                                 model_path: Path) -> None:  # fmt: skip
    before = engines(fleet)
    reference = greedy(fleet, "small")
    # Settings ride on the url: this model runs tensor parallel over three worker processes (9 heads, 3 KV heads),
    # in float32.
    url = f"{model_path}?tensor_parallel_size=3&dtype=float32&max_model_len=1024&num_kv_blocks=64"
    registered = ts(stubs, fleet, "register", "extra", url, "1")
    assert "registered with 1 initial workers" in registered["ok"]["status"], registered
    assert health(fleet, "extra") == health_pb2.HealthCheckResponse.SERVING
    assert ts(stubs, fleet, "predict", "extra", PROMPT)["ok"] == ts(stubs, fleet, "predict", "small", PROMPT)["ok"]
    info = fleet.stub().GetModelInfo(pb.ModelInfoRequest(model="extra"), timeout=10)
    assert info.context_length == 1024 and info.state == pb.MODEL_STATE_READY
    assert info.tensor_parallel_size == 3 and info.dtype == "float32"
    again = ts(stubs, fleet, "register", "extra", str(model_path), "1")
    assert again["error"].startswith("ALREADY_EXISTS")

    scaled = ts(stubs, fleet, "scale", "extra", "2")
    assert "scaled to 2" in scaled["ok"]["status"], scaled
    workers = ts(stubs, fleet, "describe", "extra")["ok"][0]["workers"]
    assert [w["status"] for w in workers] == ["READY", "READY"] and len({w["pid"] for w in workers}) == 2
    assert engines(fleet) == before + 2
    assert greedy(fleet, "extra") == reference

    assert ts(stubs, fleet, "set_default", "extra")["ok"]
    assert fleet.stub().ListModels(pb.ListModelsRequest(), timeout=10).default_model == "extra"
    assert greedy(fleet, "") == reference
    ts(stubs, fleet, "scale", "extra", "1")
    assert engines(fleet) == before + 1

    assert "unregistered" in ts(stubs, fleet, "unregister", "extra")["ok"]["status"]
    assert engines(fleet) == before
    assert [m["modelName"] for m in ts(stubs, fleet, "list")["ok"]["models"]] == ["small", "pair"]
    assert fleet.stub().ListModels(pb.ListModelsRequest(), timeout=10).default_model == "small"
    assert ts(stubs, fleet, "predict", "extra", PROMPT)["error"].startswith("NOT_FOUND")
    assert health(fleet, "extra") != health_pb2.HealthCheckResponse.SERVING
    assert ts(stubs, fleet, "set_default", "pair")["ok"]
    # The other models never stopped serving.
    assert greedy(fleet, "pair") == reference


def test_bad_registrations_are_refused_naming_the_field(fleet: RunningServer, stubs: Path, model_path: Path) -> None:
    bad_option = ts(stubs, fleet, "register", "x", f"{model_path}?tensor_parallel=2", "1")
    assert bad_option["error"].startswith("INVALID_ARGUMENT") and "tensor_parallel" in bad_option["error"]
    # The engine refuses a split the model cannot take; the caller hears why and nothing stays registered.
    indivisible = ts(stubs, fleet, "register", "x", f"{model_path}?tensor_parallel_size=2&num_kv_blocks=16", "1")
    assert indivisible["error"].startswith("FAILED_PRECONDITION") and "9 attention heads" in indivisible["error"]
    bad_dtype = ts(stubs, fleet, "register", "x", f"{model_path}?dtype=int3", "1")
    assert bad_dtype["error"].startswith("INVALID_ARGUMENT") and "dtype" in bad_dtype["error"]
    assert ts(stubs, fleet, "scale", "small", "-1")["error"].startswith("INVALID_ARGUMENT")
    assert "min_worker" in ts(stubs, fleet, "scale", "small", "65")["error"]
    assert ts(stubs, fleet, "scale", "absent", "2")["error"].startswith("NOT_FOUND")
    assert [m["modelName"] for m in ts(stubs, fleet, "list")["ok"]["models"]] == ["small", "pair"]
