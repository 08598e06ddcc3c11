"""The model catalog and manager without engines: RegisterModel URLs, the models config file, loading / draining
states, per-model health, and routing of ringserve.v1 calls by model name."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from frontend_testkit import MODEL, ScriptedEngine, completion_chunks, start_harness, until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ringserve.frontend.api.generation import GenerationServicer
from ringserve.frontend.api.server import build_catalog_server
from ringserve.frontend.catalog import ModelCatalog, ModelError, ModelManager, ModelSpec, ServedModel
from ringserve.frontend.launcher import load_models_config
from ringserve.frontend.text.tokenizer import ModelTokenizer
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc


def info(name: str) -> pb.ModelInfo:
    return pb.ModelInfo(model=name, architecture="llama", context_length=64, dtype="float32", block_size=16,
                        kv_capacity_tokens=1600)  # fmt: skip


# -- RegisterModel's url ------------------------------------------------------------------------------------


def test_a_register_url_carries_engine_settings_as_a_query_string() -> None:
    spec = ModelSpec.from_url("m", "/models/m.gguf?tensor_parallel_size=2&dtype=bfloat16&max_model_len=4096"
                                   "&kv_cache_memory_gib=1.5&data_parallel_size=3", replicas=1, max_num_seqs=32)
    assert (spec.path, spec.tensor_parallel_size, spec.dtype, spec.max_model_len) == ("/models/m.gguf", 2,
                                                                                      "bfloat16", 4096)
    assert (spec.kv_cache_memory_gib, spec.replicas, spec.max_num_seqs) == (1.5, 3, 32)
    assert ModelSpec.from_url("m", "file:///models/a%20b.gguf", 1).path == "/models/a b.gguf"


@pytest.mark.parametrize(("url", "names"), [
    ("https://hub.example/m.gguf", "https"),
    ("/m.gguf?tensor_parallel=2", "tensor_parallel"),
    ("/m.gguf?max_model_len=long", "max_model_len"),
    ("/m.gguf?dtype=int3", "dtype"),
    ("/m.gguf?kv_cache_memory_gib=nan", "kv_cache_memory_gib"),
    ("/m.gguf?tensor_parallel_size=0", "tensor_parallel_size"),
    ("", "url"),
])  # fmt: skip
def test_bad_register_urls_are_invalid_arguments_naming_the_setting(url: str, names: str) -> None:
    with pytest.raises(ModelError) as refused:
        ModelSpec.from_url("m", url, 1)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and names in refused.value.message


@pytest.mark.parametrize("name", ["", " ", "a/b", "x" * 257])
def test_model_names_must_be_usable(name: str) -> None:
    with pytest.raises(ModelError, match="model_name"):
        ModelSpec(name=name, path="/m.gguf")


# -- --models-config ----------------------------------------------------------------------------------------


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "models.toml"
    path.write_text(text)
    return str(path)


def test_a_models_config_lists_models_with_their_settings_and_default(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    specs, default = load_models_config(write(tmp_path, f'''default_model = "b"
[[models]]
model = "{gguf}"
[[models]]
name = "b"
model = "{gguf}"
data_parallel_size = 2
tensor_parallel_size = 2
max_model_len = 1024
'''))
    assert [s.name for s in specs] == ["m", "b"] and default == "b"
    assert (specs[1].replicas, specs[1].tensor_parallel_size, specs[1].max_model_len) == (2, 2, 1024)
    assert specs[0].replicas == 1 and specs[0].tensor_parallel_size is None  # the server's flag applies


@pytest.mark.parametrize(("text", "message"), [
    ("[[models]]\nname = 'a'\n", "`model`"),
    ("[[models]]\nmodel = '{gguf}'\ncolour = 'red'\n", "colour"),
    ("[[models]]\nmodel = '{gguf}'\n[[models]]\nmodel = '{gguf}'\n", "unique"),
    ("default_model = 'zz'\n[[models]]\nmodel = '{gguf}'\n", "zz"),
    ("models = 3\n", "[[models]]"),
    ("[[models]]\nmodel = '{gguf}'\ndtype = 'int3'\n", "dtype"),
    ("[[models]]\nmodel = '/no/such.gguf'\n", "no/such"),
    ("[[models]]\nmodel = '{gguf}'\nchat_template = '/no/such.jinja'\n", "models[0]: chat_template /no/such.jinja"),
    ("[[models]]\nmodel = '{gguf}'\nchat_template = 3\n", "models[0]: chat_template must be"),
    ("[[models\n", "TOML"),
])  # fmt: skip
def test_bad_models_configs_name_the_entry_and_key(tmp_path: Path, text: str, message: str) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="--models-config") as bad:
        load_models_config(write(tmp_path, text.replace("{gguf}", str(gguf))))
    assert message in str(bad.value)


# -- the manager over a scripted loader ---------------------------------------------------------------------


class ScriptedLoader:
    """Loads a model by attaching a ScriptedEngine, once `release` is set; fails for paths containing 'broken'."""

    def __init__(self, catalog: ModelCatalog, tokenizer: ModelTokenizer) -> None:
        self.catalog = catalog
        self.tokenizer = tokenizer
        self.release = asyncio.Event()
        self.release.set()
        self.engines: dict[str, ScriptedEngine] = {}

    async def __call__(self, spec: ModelSpec, model: ServedModel) -> None:
        await self.release.wait()
        if "broken" in spec.path:
            raise ModelError(grpc.StatusCode.INVALID_ARGUMENT, f"url: {spec.path} is not a model")
        engine = ScriptedEngine(completion_chunks(self.tokenizer))
        self.engines[spec.name] = engine
        servicer = GenerationServicer(engine, self.tokenizer, info(spec.name))
        self.catalog.attach(model, servicer, engine, info(spec.name))


@pytest.fixture
async def managed(tiny_tokenizer: ModelTokenizer) -> AsyncIterator[tuple[ModelManager, ScriptedLoader, str]]:
    catalog = ModelCatalog()
    loader = ScriptedLoader(catalog, tiny_tokenizer)
    manager = ModelManager(catalog, loader, drain_s=1.0)
    server = build_catalog_server(manager, port=0)
    await server.start()
    try:
        yield manager, loader, f"127.0.0.1:{server.port}"
    finally:
        await server.stop(0)


async def health(address: str, service: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
        return reply.status


async def health_becomes(address: str, service: str, status: int) -> None:
    """Health is updated by a task after each change; poll until it says `status`."""
    for _ in range(500):
        if await health(address, service) == status:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"health of {service!r} never became {status}")


async def test_models_load_serve_by_name_and_report_their_state(managed) -> None:
    manager, loader, address = managed
    await manager.register(ModelSpec(name="a", path="/a.gguf"))
    loader.release.clear()
    await manager.register(ModelSpec(name="b", path="/b.gguf"), synchronous=False)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        listed = await stub.ListModels(pb.ListModelsRequest())
        assert [(m.model, m.state) for m in listed.models] == [("a", pb.MODEL_STATE_READY),
                                                               ("b", pb.MODEL_STATE_LOADING)]
        with pytest.raises(grpc.aio.AioRpcError) as loading:
            await stub.Generate(pb.GenerateRequest(model="b", text="hi")).read()
        assert loading.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in loading.value.details()
        assert await health(address, "b") == health_pb2.HealthCheckResponse.NOT_SERVING
        loader.release.set()
        await until(lambda: manager.catalog.get("b").serving)
        async for _ in stub.Generate(pb.GenerateRequest(model="b", text="hi")):
            pass
        assert len(loader.engines["b"].submitted) == 1 and not loader.engines["a"].submitted
        await health_becomes(address, "b", health_pb2.HealthCheckResponse.SERVING)
        assert await health(address, "") == health_pb2.HealthCheckResponse.SERVING  # "a" is the default
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.Tokenize(pb.TokenizeRequest(model="c", text="hi"))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND and "'a', 'b'" in missing.value.details()


async def test_a_failed_load_is_an_error_for_a_synchronous_caller_and_failed_state_otherwise(managed) -> None:
    manager, _, _ = managed
    with pytest.raises(ModelError) as refused:
        await manager.register(ModelSpec(name="x", path="/broken.gguf"))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "x" not in manager.catalog
    model = await manager.register(ModelSpec(name="y", path="/broken.gguf"), synchronous=False)
    await until(lambda: model.load_error is not None)
    assert model.state == pb.MODEL_STATE_FAILED and "not a model" in (model.load_error or "")
    with pytest.raises(ModelError) as unavailable:
        manager.catalog.servicer_for("y")
    assert unavailable.value.code == grpc.StatusCode.UNAVAILABLE
    await manager.unregister("y")  # a failed model can be removed and registered again
    assert "y" not in manager.catalog


async def test_unregister_drains_the_model_and_moves_the_default(managed) -> None:
    manager, _, address = managed
    await manager.register(ModelSpec(name="a", path="/a.gguf"))
    await manager.register(ModelSpec(name="b", path="/b.gguf"))
    manager.set_default("b")
    model = manager.catalog.get("b")
    model.deployment = _DrainRecorder(model)  # type: ignore[assignment]
    await manager.unregister("b")
    assert model.deployment.states_seen == [pb.MODEL_STATE_DRAINING]  # type: ignore[attr-defined]
    assert manager.catalog.default_name == "a" and "b" not in manager.catalog
    await health_becomes(address, "b", health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(ModelError) as missing:
        await manager.unregister("b")
    assert missing.value.code == grpc.StatusCode.NOT_FOUND


async def test_a_model_whose_replicas_all_restart_is_restarting_not_loading(managed) -> None:
    manager, _, address = managed
    await manager.register(ModelSpec(name="a", path="/a.gguf"))
    model = manager.catalog.get("a")
    model.deployment = _Restarting()  # type: ignore[assignment]
    assert model.state == pb.MODEL_STATE_RESTARTING and model.status_text() == "RESTARTING" and not model.serving
    async with grpc.aio.insecure_channel(address) as channel:
        listed = await pb_grpc.GenerationStub(channel).ListModels(pb.ListModelsRequest())
    assert [(m.model, m.state) for m in listed.models] == [("a", pb.MODEL_STATE_RESTARTING)]
    model.deployment.restarting = False  # type: ignore[union-attr]
    assert model.state == pb.MODEL_STATE_READY and model.status_text() == "READY"


class _Restarting:
    """Stands in for a deployment none of whose replicas serves while one is being restarted."""

    restarting = True


class _DrainRecorder:
    """Stands in for a deployment: records the model's state when asked to stop."""

    def __init__(self, model: ServedModel) -> None:
        self.model = model
        self.states_seen: list[int] = []

    async def stop(self, drain_s: float) -> None:
        self.states_seen.append(self.model.state)


async def test_a_fixed_server_refuses_changes(tiny_tokenizer: ModelTokenizer) -> None:
    harness = await start_harness(tiny_tokenizer, ScriptedEngine(completion_chunks(tiny_tokenizer)))
    try:
        manager = harness.server.manager
        with pytest.raises(ModelError) as denied:
            manager.check_runtime_changes()
        assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(ModelError) as unmanaged:
            await manager.unregister(MODEL)
        assert unmanaged.value.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await harness.channel.close()
        await harness.server.stop(0)
