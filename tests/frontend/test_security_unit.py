"""TLS, mutual TLS, API keys, message size limits, malformed requests and per-model health, on the real gRPC server
built in-process against a scripted engine (no model)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import trustme
from frontend_testkit import CONTEXT_LENGTH, MODEL, ScriptedEngine, completion_chunks
from google.protobuf import empty_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from ringserve.frontend import cli, healthcheck
from ringserve.frontend.api.security import (
    ApiKeyInterceptor,
    ChannelSecurity,
    SecurityConfigError,
    ServerSecurity,
    add_channel_security_arguments,
    add_server_security_arguments,
    channel_security_from_args,
    load_api_keys,
    open_aio_channel,
    probe_security,
)
from ringserve.frontend.api.server import FrontendServer, build_server
from ringserve.frontend.text.tokenizer import ModelTokenizer
from ringserve.torchserve import inference_pb2, inference_pb2_grpc
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc

KEYS = ("key-one-0123456789", "key-two-abcdefghij")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Pki:
    """A throwaway server CA with a certificate for localhost/127.0.0.1, and a separate CA for client certificates."""

    dir: Path
    ca_file: Path
    server_cert_file: Path
    server_key_file: Path
    client_ca_file: Path
    client_cert_file: Path
    client_key_file: Path
    stranger_cert_file: Path  # a client certificate from a CA the server does not trust
    stranger_key_file: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    server_ca, client_ca, stranger_ca = trustme.CA(), trustme.CA(), trustme.CA()
    server = server_ca.issue_cert("localhost", "127.0.0.1")
    client = client_ca.issue_cert("client.example")
    stranger = stranger_ca.issue_cert("stranger.example")

    def write(name: str, data: bytes) -> Path:
        path = root / name
        path.write_bytes(data)
        return path

    def chain(cert: trustme.LeafCert) -> bytes:
        return b"".join(blob.bytes() for blob in cert.cert_chain_pems)

    return Pki(root, write("ca.pem", server_ca.cert_pem.bytes()), write("server.pem", chain(server)),
               write("server.key", server.private_key_pem.bytes()), write("client-ca.pem", client_ca.cert_pem.bytes()),
               write("client.pem", chain(client)), write("client.key", client.private_key_pem.bytes()),
               write("stranger.pem", chain(stranger)), write("stranger.key", stranger.private_key_pem.bytes()))


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_security_arguments(parser)
    return parser.parse_args(argv)


def client_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_channel_security_arguments(parser)
    return parser.parse_args(argv)


@contextlib.asynccontextmanager
async def running(tokenizer: ModelTokenizer, security: ServerSecurity | None,
                  engine: ScriptedEngine | None = None) -> AsyncIterator[FrontendServer]:  # fmt: skip
    info = pb.ModelInfo(model=MODEL, architecture="llama", context_length=CONTEXT_LENGTH, dtype="float32",
                        tensor_parallel_size=1, block_size=16, kv_capacity_tokens=1600,
                        eos_token_ids=tokenizer.eos_token_ids, vocab_size=tokenizer.vocab_size)
    server = build_server(engine or ScriptedEngine(completion_chunks(tokenizer)), tokenizer, info, port=0,
                          security=security)  # fmt: skip
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=None)


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def status_of(call: object) -> grpc.StatusCode:
    """OK, or the status the RPC failed with; a stream is read to its end."""
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:  # type: ignore[attr-defined]
                pass
        else:
            await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


# -- configuration --------------------------------------------------------------------------------------------------


def test_api_keys_come_comma_separated_and_from_a_file_with_comments(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# rotated 2025-01\nfile-key-1\n\nfile-key-2, key-a\n")
    assert load_api_keys("key-a, key-b,", str(key_file)) == ("key-a", "key-b", "file-key-1", "file-key-2")


@pytest.mark.parametrize("keys", ["has space", "naïve", "tab\tkey"])
def test_api_keys_must_be_printable_ascii_without_spaces(keys: str) -> None:
    with pytest.raises(SecurityConfigError, match="--api-key"):
        load_api_keys(keys, "")


def test_an_empty_key_file_is_an_error_not_an_open_server(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("# nothing yet\n")
    with pytest.raises(SecurityConfigError, match="no key"):
        load_api_keys("", str(tmp_path / "keys"))


def test_serve_flags_read_their_environment_variables(monkeypatch: pytest.MonkeyPatch, pki: Pki) -> None:
    monkeypatch.setenv("RINGSERVE_TLS_CERT_FILE", str(pki.server_cert_file))
    monkeypatch.setenv("RINGSERVE_TLS_KEY_FILE", str(pki.server_key_file))
    monkeypatch.setenv("RINGSERVE_TLS_CLIENT_CA_FILE", str(pki.client_ca_file))
    monkeypatch.setenv("RINGSERVE_API_KEY", ",".join(KEYS))
    monkeypatch.setenv("RINGSERVE_MAX_MESSAGE_SIZE_MIB", "8")
    security = ServerSecurity.from_args(serve_args())
    assert security.tls and security.mutual_tls
    assert security.api_keys == KEYS
    assert dict(security.options())["grpc.max_receive_message_length"] == 8 << 20
    assert KEYS[0] not in repr(security) and "PRIVATE" not in repr(security)
    assert "mutual TLS" in security.describe() and KEYS[0] not in security.describe()


def test_default_is_plaintext_without_keys_and_64_mib_messages() -> None:
    security = ServerSecurity.from_args(serve_args())
    assert not security.tls and not security.api_keys
    assert dict(security.options()) == {"grpc.max_receive_message_length": 64 << 20,
                                        "grpc.max_send_message_length": 64 << 20}


@pytest.mark.parametrize(("flags", "message"), [
    (("--tls-cert-file", "{cert}"), "--tls-key-file"),
    (("--tls-client-ca-file", "{ca}"), "needs TLS"),
    (("--tls-cert-file", "{missing}", "--tls-key-file", "{key}"), "--tls-cert-file .*cannot read"),
    (("--tls-cert-file", "{key}", "--tls-key-file", "{key}"), "--tls-cert-file .*CERTIFICATE"),
    (("--max-message-size-mib", "0"), "--max-message-size-mib"),
    (("--tls-cert-file", "{cert}", "--tls-key-file", "{client_key}"), "--tls-key-file .*private key"),
    (("--tls-cert-file", "{cert}", "--tls-key-file", "{key}", "--tls-client-ca-file", "{key}"), "--tls-client-ca-file"),
])  # fmt: skip
def test_bad_tls_settings_name_the_flag_to_change(pki: Pki, flags: tuple[str, ...], message: str) -> None:
    paths = {"cert": pki.server_cert_file, "key": pki.server_key_file, "ca": pki.client_ca_file,
             "missing": pki.dir / "missing.pem", "client_key": pki.client_key_file}
    with pytest.raises(SecurityConfigError, match=message):
        ServerSecurity.from_args(serve_args(*(flag.format(**paths) for flag in flags)))


def test_client_sends_an_api_key_only_over_tls_or_to_loopback() -> None:
    with_key = ChannelSecurity(api_key="k")
    assert with_key.channel_credentials("127.0.0.1") is not None
    assert with_key.channel_credentials("localhost") is not None
    with pytest.raises(SecurityConfigError, match="--tls"):
        with_key.channel_credentials("10.1.2.3")
    assert ChannelSecurity(tls=True, api_key="k").channel_credentials("10.1.2.3") is not None
    assert ChannelSecurity().channel_credentials("10.1.2.3") is None  # plain insecure channel


def test_client_flags_take_the_first_key_and_imply_tls(monkeypatch: pytest.MonkeyPatch, pki: Pki) -> None:
    monkeypatch.setenv("RINGSERVE_API_KEY", ",".join(KEYS))  # the server's list, as in `docker exec`
    security = channel_security_from_args(client_args("--tls-ca-file", str(pki.ca_file), "--tls-server-name", "x"))
    assert security.api_key == KEYS[0]
    assert security.uses_tls
    assert security.options() == [("grpc.ssl_target_name_override", "x")]


def test_health_probe_derives_tls_from_the_servers_environment(pki: Pki) -> None:
    assert probe_security({}) == ChannelSecurity()
    tls = probe_security({"RINGSERVE_TLS_CERT_FILE": "/c.pem", "RINGSERVE_TLS_KEY_FILE": "/k.pem"})
    assert tls.uses_tls and tls.ca_file == "/c.pem" and not tls.cert_file
    mutual = probe_security({"RINGSERVE_TLS_CERT_FILE": "/c.pem", "RINGSERVE_TLS_KEY_FILE": "/k.pem",
                             "RINGSERVE_TLS_CLIENT_CA_FILE": "/ca.pem", "RINGSERVE_TLS_CA_FILE": "/root.pem"})
    assert (mutual.ca_file, mutual.cert_file, mutual.key_file) == ("/root.pem", "/c.pem", "/k.pem")
    own = probe_security({"RINGSERVE_TLS_CERT_FILE": "/c.pem", "RINGSERVE_TLS_CLIENT_CA_FILE": "/ca.pem",
                          "RINGSERVE_TLS_CLIENT_CERT_FILE": "/probe.pem", "RINGSERVE_TLS_CLIENT_KEY_FILE": "/p.key"})
    assert (own.cert_file, own.key_file) == ("/probe.pem", "/p.key")
    assert not probe_security({"RINGSERVE_API_KEY": "k"}).api_key  # health is open


def test_bearer_check_compares_every_key_and_names_the_problem() -> None:
    interceptor = ApiKeyInterceptor(KEYS)
    assert interceptor.check(bearer(KEYS[1])) is None
    assert interceptor.check((("authorization", f"bearer   {KEYS[0]}  "),)) is None  # scheme is case-insensitive
    assert "missing API key" in (interceptor.check(()) or "")
    assert "missing API key" in (interceptor.check(None) or "")
    assert "Bearer" in (interceptor.check((("authorization", f"Basic {KEYS[0]}"),)) or "")
    assert "Bearer" in (interceptor.check((("authorization", "Bearer "),)) or "")
    assert interceptor.check(bearer(KEYS[0] + "x")) == "invalid API key"
    assert interceptor.check(bearer(KEYS[0][:-1])) == "invalid API key"


# -- API keys on a running server -----------------------------------------------------------------------------------


async def test_api_key_is_required_on_unary_streaming_and_torchserve_rpcs(tiny_tokenizer: ModelTokenizer) -> None:
    async with running(tiny_tokenizer, ServerSecurity(api_keys=KEYS)) as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            torchserve = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
            prediction = inference_pb2.PredictionsRequest(model_name=MODEL, input={"data": b"hello"})

            def rpcs(metadata: tuple[tuple[str, str], ...]) -> list[object]:
                return [stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=metadata, timeout=5),
                        stub.Generate(pb.GenerateRequest(text="hi"), metadata=metadata, timeout=5),
                        torchserve.Predictions(prediction, metadata=metadata, timeout=5),
                        torchserve.StreamPredictions(prediction, metadata=metadata, timeout=5)]

            for metadata in ((), bearer("wrong-key")):
                assert [await status_of(call) for call in rpcs(metadata)] == [grpc.StatusCode.UNAUTHENTICATED] * 4
            for key in KEYS:
                assert [await status_of(call) for call in rpcs(bearer(key))] == [grpc.StatusCode.OK] * 4

            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.GetModelInfo(pb.ModelInfoRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization: Bearer" in (refused.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as wrong:
                await stub.GetModelInfo(pb.ModelInfoRequest(), metadata=bearer("nope"), timeout=5)
            assert wrong.value.details() == "invalid API key"


async def test_health_reflection_and_torchserve_ping_stay_open(tiny_tokenizer: ModelTokenizer) -> None:
    async with running(tiny_tokenizer, ServerSecurity(api_keys=KEYS)) as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            await wait_for_status(health, "", SERVING)
            ping = await inference_pb2_grpc.InferenceAPIsServiceStub(channel).Ping(empty_pb2.Empty(), timeout=5)
            assert "Healthy" in ping.health
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = [s.name async for reply in replies for s in reply.list_services_response.service]
            assert "ringserve.v1.Generation" in names


async def test_api_key_client_flags_reach_the_server(tiny_tokenizer: ModelTokenizer,
                                                     capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    async with running(tiny_tokenizer, ServerSecurity(api_keys=KEYS)) as server:
        port = str(server.port)
        refused = await asyncio.to_thread(cli.main, ["model-info", "--port", port, "--timeout", "5"])
        assert refused == 1 and "UNAUTHENTICATED" in capsys.readouterr().err
        served = await asyncio.to_thread(cli.main, ["model-info", "--port", port, "--api-key", KEYS[1]])
        assert served == 0 and f'"model": "{MODEL}"' in capsys.readouterr().out


# -- malformed requests and message sizes ---------------------------------------------------------------------------


async def test_undecodable_request_bytes_are_invalid_argument_not_unknown(tiny_tokenizer: ModelTokenizer) -> None:
    async with running(tiny_tokenizer, None) as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            valid = pb.GenerateRequest(text="ab").SerializeToString()
            for raw in (valid.replace(b"ab", b"\xff\xfe"), b"\xff\xff\xff\xff", valid[:-1]):
                generate = channel.unary_stream("/ringserve.v1.Generation/Generate")(raw, timeout=5)
                assert await status_of(generate) == grpc.StatusCode.INVALID_ARGUMENT
                tokenize = channel.unary_unary("/ringserve.v1.Generation/Tokenize")(raw, timeout=5)
                assert await status_of(tokenize) == grpc.StatusCode.INVALID_ARGUMENT
            responses = [r async for r in pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(text="ab"))]
            assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH


async def test_oversize_request_is_resource_exhausted_and_the_server_keeps_serving(
        tiny_tokenizer: ModelTokenizer) -> None:  # fmt: skip
    async with running(tiny_tokenizer, ServerSecurity(max_message_bytes=1 << 20)) as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            huge = pb.GenerateRequest(text="x" * (2 << 20))
            assert await status_of(stub.Generate(huge, timeout=10)) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert await status_of(stub.Tokenize(pb.TokenizeRequest(text="y" * (2 << 20)), timeout=10)) == \
                grpc.StatusCode.RESOURCE_EXHAUSTED
            assert await status_of(stub.Generate(pb.GenerateRequest(text="hi"), timeout=10)) == grpc.StatusCode.OK


# -- TLS and mutual TLS ---------------------------------------------------------------------------------------------


def tls_server(pki: Pki, *, mutual: bool, keys: tuple[str, ...] = ()) -> ServerSecurity:
    return ServerSecurity(certificate_chain=pki.server_cert_file.read_bytes(),
                          private_key=pki.server_key_file.read_bytes(),
                          client_ca=pki.client_ca_file.read_bytes() if mutual else b"", api_keys=keys)


async def generate_status(address: str, security: ChannelSecurity | None) -> grpc.StatusCode:
    async with open_aio_channel(address, security) as channel:
        call = pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(text="hi"), timeout=5)
        return await status_of(call)


async def test_tls_server_streams_to_tls_clients_and_refuses_plaintext(tiny_tokenizer: ModelTokenizer,
                                                                       pki: Pki) -> None:  # fmt: skip
    async with running(tiny_tokenizer, tls_server(pki, mutual=False, keys=KEYS)) as server:
        address = f"127.0.0.1:{server.port}"
        trusted = ChannelSecurity(ca_file=str(pki.ca_file), api_key=KEYS[0])
        assert await generate_status(address, trusted) == grpc.StatusCode.OK
        by_name = ChannelSecurity(ca_file=str(pki.ca_file), server_name="localhost", api_key=KEYS[0])
        assert await generate_status(address, by_name) == grpc.StatusCode.OK
        assert await generate_status(address, ChannelSecurity()) == grpc.StatusCode.UNAVAILABLE  # plaintext
        assert await generate_status(address, ChannelSecurity(ca_file=str(pki.client_ca_file))) == \
            grpc.StatusCode.UNAVAILABLE  # the client does not trust the server's CA
        wrong_name = ChannelSecurity(ca_file=str(pki.ca_file), server_name="other.example", api_key=KEYS[0])
        assert await generate_status(address, wrong_name) == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_requires_a_client_certificate_from_the_client_ca(tiny_tokenizer: ModelTokenizer,
                                                                           pki: Pki) -> None:  # fmt: skip
    async with running(tiny_tokenizer, tls_server(pki, mutual=True)) as server:
        address = f"127.0.0.1:{server.port}"
        no_cert = ChannelSecurity(ca_file=str(pki.ca_file))
        assert await generate_status(address, no_cert) == grpc.StatusCode.UNAVAILABLE
        stranger = ChannelSecurity(ca_file=str(pki.ca_file), cert_file=str(pki.stranger_cert_file),
                                   key_file=str(pki.stranger_key_file))
        assert await generate_status(address, stranger) == grpc.StatusCode.UNAVAILABLE
        client = ChannelSecurity(ca_file=str(pki.ca_file), cert_file=str(pki.client_cert_file),
                                 key_file=str(pki.client_key_file))
        assert await generate_status(address, client) == grpc.StatusCode.OK


async def test_health_probe_reaches_a_mutual_tls_server_from_its_environment(
        tiny_tokenizer: ModelTokenizer, pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    async with running(tiny_tokenizer, tls_server(pki, mutual=True, keys=KEYS)) as server:
        monkeypatch.setenv("RINGSERVE_PORT", str(server.port))
        monkeypatch.setenv("RINGSERVE_HOST", "0.0.0.0")
        monkeypatch.setenv("RINGSERVE_TLS_CERT_FILE", str(pki.server_cert_file))
        monkeypatch.setenv("RINGSERVE_TLS_KEY_FILE", str(pki.server_key_file))
        monkeypatch.setenv("RINGSERVE_TLS_CLIENT_CA_FILE", str(pki.client_ca_file))
        monkeypatch.setenv("RINGSERVE_API_KEY", ",".join(KEYS))
        # Neither trusted by the probe (a leaf, not its CA) nor a client certificate from the client CA: refused.
        assert await asyncio.to_thread(healthcheck.main, []) == healthcheck.UNHEALTHY
        monkeypatch.setenv("RINGSERVE_TLS_CA_FILE", str(pki.ca_file))
        monkeypatch.setenv("RINGSERVE_TLS_CLIENT_CERT_FILE", str(pki.client_cert_file))
        monkeypatch.setenv("RINGSERVE_TLS_CLIENT_KEY_FILE", str(pki.client_key_file))
        await wait_until(lambda: asyncio.to_thread(healthcheck.main, []), healthcheck.HEALTHY)


async def test_health_probe_trusts_the_root_in_the_servers_certificate_file(
        tiny_tokenizer: ModelTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")  # served with its root appended, as a private CA's bundle often is
    (tmp_path / "chain.pem").write_bytes(b"".join(b.bytes() for b in leaf.cert_chain_pems) + ca.cert_pem.bytes())
    (tmp_path / "leaf.key").write_bytes(leaf.private_key_pem.bytes())
    security = ServerSecurity(certificate_chain=(tmp_path / "chain.pem").read_bytes(),
                              private_key=(tmp_path / "leaf.key").read_bytes())
    async with running(tiny_tokenizer, security) as server:
        monkeypatch.setenv("RINGSERVE_PORT", str(server.port))
        monkeypatch.setenv("RINGSERVE_TLS_CERT_FILE", str(tmp_path / "chain.pem"))
        monkeypatch.setenv("RINGSERVE_TLS_KEY_FILE", str(tmp_path / "leaf.key"))
        await wait_until(lambda: asyncio.to_thread(healthcheck.main, []), healthcheck.HEALTHY)


async def test_cli_client_speaks_mutual_tls_with_an_api_key(tiny_tokenizer: ModelTokenizer, pki: Pki,
                                                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    async with running(tiny_tokenizer, tls_server(pki, mutual=True, keys=KEYS)) as server:
        argv = ["tokenize", "--port", str(server.port), "--timeout", "5", "--tls-ca-file", str(pki.ca_file),
                "--tls-client-cert-file", str(pki.client_cert_file), "--tls-client-key-file",
                str(pki.client_key_file), "--api-key", KEYS[0], "hello"]  # fmt: skip
        assert await asyncio.to_thread(cli.main, argv) == 0
        assert capsys.readouterr().out.split() == [str(i) for i in tiny_tokenizer.encode("hello", True)]
        half = [*argv[:argv.index("--tls-client-key-file")], "hello"]
        assert await asyncio.to_thread(cli.main, half) == 2
        assert "--tls-client-key-file" in capsys.readouterr().err


# -- health per model -----------------------------------------------------------------------------------------------


async def wait_until(probe: object, expected: object, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        got = await probe()  # type: ignore[operator]
        if got == expected or asyncio.get_running_loop().time() > deadline:
            assert got == expected
            return
        await asyncio.sleep(0.05)


async def wait_for_status(health: health_pb2_grpc.HealthStub, service: str, expected: int) -> None:
    async def probe() -> int:
        return (await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status

    await wait_until(probe, expected)


HEALTH_NAMES = ("", MODEL, "ringserve.v1.Generation", "org.pytorch.serve.grpc.inference.InferenceAPIsService",
                "org.pytorch.serve.grpc.management.ManagementAPIsService")


async def test_health_per_model_and_service_turns_not_serving_on_engine_failure(
        tiny_tokenizer: ModelTokenizer) -> None:  # fmt: skip
    engine = ScriptedEngine(completion_chunks(tiny_tokenizer))
    async with running(tiny_tokenizer, None, engine) as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in HEALTH_NAMES:
                await wait_for_status(health, name, SERVING)
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await health.Check(health_pb2.HealthCheckRequest(service="no-such-model"), timeout=5)
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
            engine.fail("worker 0 died")
            for name in HEALTH_NAMES:
                await wait_for_status(health, name, NOT_SERVING)


async def test_health_watch_of_the_model_sees_not_serving_when_draining(tiny_tokenizer: ModelTokenizer) -> None:
    engine = ScriptedEngine(completion_chunks(tiny_tokenizer), hang_after=1)
    async with running(tiny_tokenizer, None, engine) as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=MODEL))
            updates = watch.__aiter__()
            while (await updates.__anext__()).status != SERVING:
                pass
            in_flight = pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(text="hi"))
            await in_flight.read()
            stopping = asyncio.create_task(server.stop(grace=2.0))
            assert (await asyncio.wait_for(updates.__anext__(), 5)).status == NOT_SERVING
            await stopping
            assert await in_flight.code() != grpc.StatusCode.OK  # still running at the end of the drain: cut
