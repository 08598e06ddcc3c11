"""The real server with mutual TLS, API keys and a small message limit: who gets in, who does not, and that the CLI
client and the container health probe still work."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ringserve.torchserve import inference_pb2, inference_pb2_grpc
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc
from server_harness import RunningServer, free_port

KEYS = ("integration-key-1", "integration-key-2")
SERVED_NAME = "smollm2-secured"


@dataclass
class SecureServer:
    running: RunningServer
    dir: Path  # certificates and keys
    env: dict[str, str]  # the RINGSERVE_* variables the server was started with

    @property
    def address(self) -> str:
        return self.running.address

    def credentials(self, *, client_cert: bool = True) -> grpc.ChannelCredentials:
        cert = (self.dir / "client.pem").read_bytes() if client_cert else None
        key = (self.dir / "client.key").read_bytes() if client_cert else None
        return grpc.ssl_channel_credentials((self.dir / "ca.pem").read_bytes(), key, cert)

    def channel(self, *, client_cert: bool = True) -> grpc.Channel:
        return grpc.secure_channel(self.address, self.credentials(client_cert=client_cert))


def wait_until_serving(server: RunningServer, credentials: grpc.ChannelCredentials, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.secure_channel(server.address, credentials) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise AssertionError(f"server exited with {server.proc.returncode} while starting\n{server.log()}")
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.25)
    raise AssertionError(f"server not SERVING after {timeout_s}s\n{server.log()}")


@pytest.fixture(scope="module")
def secure_server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureServer]:
    root = tmp_path_factory.mktemp("secure")
    server_ca, client_ca = trustme.CA(), trustme.CA()
    server_cert, client_cert = server_ca.issue_cert("localhost", "127.0.0.1"), client_ca.issue_cert("client")
    server_ca.cert_pem.write_to_path(str(root / "ca.pem"))
    client_ca.cert_pem.write_to_path(str(root / "client-ca.pem"))
    server_cert.cert_chain_pems[0].write_to_path(str(root / "server.pem"))
    server_cert.private_key_pem.write_to_path(str(root / "server.key"))
    client_cert.cert_chain_pems[0].write_to_path(str(root / "client.pem"))
    client_cert.private_key_pem.write_to_path(str(root / "client.key"))
    (root / "api-keys").write_text("# one key per line\n" + "\n".join(KEYS) + "\n")

    port = free_port()
    # TLS files by flag, the API keys by environment variable: both ways of configuring are exercised.
    env = {"RINGSERVE_API_KEY_FILE": str(root / "api-keys"), "RINGSERVE_MAX_MESSAGE_SIZE_MIB": "1"}
    cmd = [sys.executable, "-m", "ringserve.frontend.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", str(model_path), "--dtype", "float32", "--served-model-name", SERVED_NAME,
           "--num-kv-blocks", "64", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
           "--tls-cert-file", str(root / "server.pem"), "--tls-key-file", str(root / "server.key"),
           "--tls-client-ca-file", str(root / "client-ca.pem")]  # fmt: skip
    log_path = root / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    with RunningServer(proc, port, log_path) as running:
        server = SecureServer(running, root, env)
        wait_until_serving(running, server.credentials())
        yield server
        code = running.stop()
    assert code == 0, f"server exited with {code} on SIGTERM\n{running.log()}"


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def status_of(rpc: Callable[[], object]) -> grpc.StatusCode:
    """OK, or the status the RPC failed with; a stream is read to its end."""
    try:
        result = rpc()
        if isinstance(result, Iterator):
            for _ in result:
                pass
    except grpc.RpcError as error:
        return error.code()  # type: ignore[attr-defined]
    return grpc.StatusCode.OK


def short_generate(text: str = "The capital of France is") -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=4, temperature=0.0))


def test_tls_client_with_a_certificate_and_key_streams_a_completion(secure_server: SecureServer) -> None:
    with secure_server.channel() as channel:
        responses = list(pb_grpc.GenerationStub(channel).Generate(short_generate(), metadata=bearer(KEYS[0]),
                                                                  timeout=60))  # fmt: skip
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert sum(len(r.token_ids) for r in responses) == 4 and "".join(r.text for r in responses)


def test_plaintext_and_certificateless_clients_are_refused(secure_server: SecureServer) -> None:
    with grpc.insecure_channel(secure_server.address) as plaintext:
        stub = pb_grpc.GenerationStub(plaintext)
        assert status_of(lambda: stub.Generate(short_generate(), metadata=bearer(KEYS[0]), timeout=10)) == \
            grpc.StatusCode.UNAVAILABLE
    with secure_server.channel(client_cert=False) as no_cert:
        stub = pb_grpc.GenerationStub(no_cert)
        assert status_of(lambda: stub.Generate(short_generate(), metadata=bearer(KEYS[0]), timeout=10)) == \
            grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize(("metadata", "expected"), [
    ((), grpc.StatusCode.UNAUTHENTICATED),
    (bearer("not-a-key"), grpc.StatusCode.UNAUTHENTICATED),
    ((("authorization", f"Basic {KEYS[0]}"),), grpc.StatusCode.UNAUTHENTICATED),
    (bearer(KEYS[0]), grpc.StatusCode.OK),
    (bearer(KEYS[1]), grpc.StatusCode.OK),
])  # fmt: skip
def test_api_key_guards_streaming_unary_and_torchserve_rpcs(secure_server: SecureServer, metadata: tuple,
                                                            expected: grpc.StatusCode) -> None:  # fmt: skip
    with secure_server.channel() as channel:
        stub = pb_grpc.GenerationStub(channel)
        torchserve = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        prediction = inference_pb2.PredictionsRequest(
            model_name=SERVED_NAME, input={"data": b'{"prompt": "Hello", "max_new_tokens": 2}'})
        rpcs: dict[str, Callable[[], object]] = {
            "Generate": lambda: stub.Generate(short_generate(), metadata=metadata, timeout=60),
            "Tokenize": lambda: stub.Tokenize(pb.TokenizeRequest(text="Hello"), metadata=metadata, timeout=60),
            "Predictions": lambda: torchserve.Predictions(prediction, metadata=metadata, timeout=60),
        }
        assert {name: status_of(rpc) for name, rpc in rpcs.items()} == dict.fromkeys(rpcs, expected)


def test_health_per_model_and_reflection_need_no_key(secure_server: SecureServer) -> None:
    with secure_server.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVED_NAME, "ringserve.v1.Generation"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for reply in replies for s in reply.list_services_response.service}
        assert "ringserve.v1.Generation" in names


def test_oversize_request_is_resource_exhausted_and_the_server_keeps_serving(secure_server: SecureServer) -> None:
    with secure_server.channel() as channel:
        stub = pb_grpc.GenerationStub(channel)
        huge = pb.GenerateRequest(text="word " * (300 << 10), sampling=pb.SamplingParams(max_tokens=1))  # 1.5 MiB
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(huge, metadata=bearer(KEYS[0]), timeout=30))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        responses = list(stub.Generate(short_generate(), metadata=bearer(KEYS[0]), timeout=60))
        assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH


def client_env(secure_server: SecureServer, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGSERVE_")}
    return {**env, "RINGSERVE_PORT": str(secure_server.running.port), **extra}


def test_cli_generate_over_mutual_tls_with_an_api_key(secure_server: SecureServer) -> None:
    root = secure_server.dir
    argv = [sys.executable, "-m", "ringserve.frontend.cli", "generate", "--raw", "--max-tokens", "4",
            "--temperature", "0", "--tls-ca-file", str(root / "ca.pem"), "--tls-client-cert-file",
            str(root / "client.pem"), "--tls-client-key-file", str(root / "client.key"), "The capital of France is"]
    refused = subprocess.run(argv, env=client_env(secure_server), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
    served = subprocess.run(argv, env=client_env(secure_server, RINGSERVE_API_KEY=KEYS[1]), capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert served.returncode == 0, served.stderr
    assert served.stdout.strip()


def test_container_health_probe_works_with_mutual_tls_and_keys_on(secure_server: SecureServer) -> None:
    root = secure_server.dir
    server_env = {"RINGSERVE_HOST": "0.0.0.0", "RINGSERVE_TLS_CERT_FILE": str(root / "server.pem"),
                  "RINGSERVE_TLS_KEY_FILE": str(root / "server.key"),
                  "RINGSERVE_TLS_CLIENT_CA_FILE": str(root / "client-ca.pem"), **secure_server.env}
    probe = [sys.executable, "-m", "ringserve.frontend.healthcheck"]
    # The server's certificate is a leaf of another CA: the probe needs the CA and a client certificate named.
    without = subprocess.run(probe, env=client_env(secure_server, **server_env), capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    assert without.returncode == 1
    configured = client_env(secure_server, **server_env, RINGSERVE_TLS_CA_FILE=str(root / "ca.pem"),
                            RINGSERVE_TLS_CLIENT_CERT_FILE=str(root / "client.pem"),
                            RINGSERVE_TLS_CLIENT_KEY_FILE=str(root / "client.key"))
    healthy = subprocess.run(probe, env=configured, capture_output=True, text=True, timeout=60)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert "SERVING" in healthy.stdout


def test_plain_server_reports_health_under_the_served_model_name(server: RunningServer) -> None:
    with server.channel() as channel:
        model = pb_grpc.GenerationStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=10).model
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", model, "ringserve.v1.Generation",
                        "org.pytorch.serve.grpc.inference.InferenceAPIsService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
