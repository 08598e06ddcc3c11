"""EngineArgs: the one declaration of the engine's settings, its flags, its JSON and its checks."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest
from ringserve.formats.engine_args import EngineArgs, add_engine_arguments, default_worker_threads


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser


def test_every_flag_defaults_to_the_field_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("RINGSERVE_")]:  # e.g. the integration tests' quantization
        monkeypatch.delenv(name)
    assert EngineArgs.from_namespace(engine_parser().parse_args([])) == EngineArgs()


def test_only_the_per_server_settings_are_flags() -> None:
    flags = {a.dest for a in engine_parser()._actions if a.dest != "help"}
    assert "block_size" in flags and "enable_prefix_caching" in flags and "kv_transfer" in flags
    assert not flags & {"model_path", "eos_token_ids", "model_id", "kv_info_dir"}  # the frontend fills these per model
    assert flags | {"model_path", "eos_token_ids", "model_id", "kv_info_dir"} == {
        f.name for f in dataclasses.fields(EngineArgs)}


def test_flags_parse_into_typed_fields_and_read_ringserve_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGSERVE_BLOCK_SIZE", "32")
    monkeypatch.setenv("RINGSERVE_ENABLE_PREFIX_CACHING", "off")
    args = EngineArgs.from_namespace(engine_parser().parse_args(["--kv-cache-memory-gib", "2", "--spec-min-acceptance",
                                                                 "0.5", "--draft", "layers:2"]))  # fmt: skip
    assert (args.block_size, args.enable_prefix_caching) == (32, False)
    assert (args.kv_cache_memory_gib, args.spec_min_acceptance, args.draft) == (2.0, 0.5, "layers:2")
    assert EngineArgs.from_namespace(engine_parser().parse_args(["--enable-prefix-caching"])).enable_prefix_caching
    monkeypatch.setenv("RINGSERVE_BLOCK_SIZE", "big")
    with pytest.raises(ValueError, match="RINGSERVE_BLOCK_SIZE"):
        engine_parser()


def test_help_names_the_environment_variable_and_the_default() -> None:
    text = engine_parser().format_help()
    assert "tokens per KV cache block (default 16) (env RINGSERVE_BLOCK_SIZE)" in " ".join(text.split())
    assert "--no-enable-prefix-caching" in text


def test_json_round_trips_every_field() -> None:
    args = EngineArgs(model_path="/models/m.gguf", dtype="bfloat16", tensor_parallel_size=2, max_model_len=4096,
                      max_step_slowdown="2.0", num_speculative_tokens=4, draft="layers:2", spec_tree="2x2",
                      spec_min_acceptance=0.5, enable_prefix_caching=False, kv_cache_memory_gib=3.0, worker_threads=2,
                      kv_transfer="shm", eos_token_ids=(2, 7), model_id="llama:m", kv_info_dir="/tmp/kv")  # fmt: skip
    assert EngineArgs.from_json(args.to_json()) == args
    assert EngineArgs.from_json('{"block_size": 8}') == EngineArgs(block_size=8)  # a missing field: its default
    assert EngineArgs.from_json('{"kv_cache_memory_gib": 2}').kv_cache_memory_gib == 2.0


@pytest.mark.parametrize(("text", "message"), [
    ('{"blocksize": 8}', "unknown key"), ('{"block_size": "8"}', "block_size: expected int"),
    ('{"enable_prefix_caching": 1}', "enable_prefix_caching: expected bool"),
    ('{"block_size": true}', "block_size: expected int"), ('{"eos_token_ids": [2, "x"]}', "eos_token_ids"),
    ("[1]", "JSON object"), ("{", "not JSON"),
])  # fmt: skip
def test_json_that_does_not_fit_is_refused_naming_the_key(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs.from_json(text)


@pytest.mark.parametrize(("changes", "message"), [
    ({"tensor_parallel_size": 0}, "--tensor-parallel-size must be at least 1"),
    ({"block_size": 0}, "--block-size must be at least 1"),
    ({"num_speculative_tokens": 9}, "--num-speculative-tokens must be in [0, 8]"),
    ({"prompt_lookup_min": 5}, "--prompt-lookup-min (5) must be >= 1 and <= --prompt-lookup-max"),
    ({"draft": "/no/such/draft"}, "--draft '/no/such/draft'"),
    ({"max_step_slowdown": "fast"}, "--max-step-slowdown must be 0 (off) or >= 1"),
    ({"attention_backend": "flash"}, "--attention-backend 'flash': expected one of auto, torch_sdpa, triton_paged"),
    ({"kv_cache_memory_gib": 0.0}, "--kv-cache-memory-gib > 0"),
    ({"pipeline_parallel_size": 0}, "--pipeline-parallel-size must be at least 1"),
    ({"tensor_parallel_size": 3, "pipeline_parallel_size": 3},
     "--tensor-parallel-size 3 x --pipeline-parallel-size 3 = 9 worker processes; one engine starts at most 8"),
    ({"pipeline_parallel_size": 2, "num_speculative_tokens": 2}, "--pipeline-parallel-size > 1 does not support spec"),
    ({"step_timeout": -1.0}, "--step-timeout must be >= 0 seconds (0 = no limit; got -1.0)"),
    ({"step_timeout": float("inf")}, "--step-timeout must be >= 0 seconds"),
    ({"step_timeout": float("nan")}, "--step-timeout must be >= 0 seconds"),
    ({"pipeline_parallel_size": 2, "kv_transfer": "shm"}, "--pipeline-parallel-size > 1 does not support --kv-trans"),
])  # fmt: skip
def test_a_setting_that_cannot_work_is_refused_naming_its_flag(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as error:
        EngineArgs(**changes)  # type: ignore[arg-type]
    assert message in str(error.value)
    with pytest.raises(ValueError):
        dataclasses.replace(EngineArgs(), **changes)  # every copy is checked too


def test_unresolved_lists_the_choices_left_to_the_frontend() -> None:
    assert EngineArgs().unresolved() == ["--dtype", "--max-step-slowdown", "--kv-transfer", "--max-model-len"]
    resolved = EngineArgs(dtype="float32", max_step_slowdown="0", kv_transfer="none", max_model_len=64)
    assert resolved.unresolved() == []


def test_a_draft_tree_has_the_depth_of_the_speculative_tokens() -> None:
    assert EngineArgs(num_speculative_tokens=4, draft="layers:2").draft_tree() is None
    tree = EngineArgs(num_speculative_tokens=4, draft="layers:2", spec_tree="2x2").draft_tree()
    assert tree is not None and tree.num_nodes == 14


def test_default_worker_threads_leave_one_cpu_to_the_frontend_and_engine() -> None:
    assert [default_worker_threads(cpus, 1) for cpus in (1, 2, 3, 4, 16)] == [1, 1, 2, 3, 15]
    assert default_worker_threads(8, 2) == 3  # (8 - 1) // 2 per rank
    assert default_worker_threads(2, 4) == 1  # never below one per rank


def test_the_ray_executor_is_refused_where_ray_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=r"--distributed-executor ray needs Ray.*pip install 'ringserve\[ray\]'"):
        EngineArgs(distributed_executor="ray")
    assert EngineArgs(distributed_executor="mp").distributed_executor == "mp"
    with pytest.raises(ValueError, match="--placement-strategy 'BOTH'"):
        EngineArgs(placement_strategy="BOTH")


def pretend_ray_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "ray" else real(name, *a))


def test_ray_ranks_go_past_eight_up_to_eight_nodes_of_eight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a step ring's readers bound the ranks: 8 on one host (mp); with Ray a reader per node and per rank on a
    node, so 64 (backend/ray_executor.py checks the placement itself)."""
    pretend_ray_is_installed(monkeypatch)
    for tp, pp in ((4, 4), (8, 2), (8, 8), (1, 16)):
        args = EngineArgs(distributed_executor="ray", tensor_parallel_size=tp, pipeline_parallel_size=pp)
        assert args.world_size == tp * pp
    with pytest.raises(ValueError, match=r"= 9 worker processes; one engine starts at most 8 on its host .*"
                                         "--distributed-executor ray places more on several nodes"):  # fmt: skip
        EngineArgs(tensor_parallel_size=3, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 13 x --pipeline-parallel-size 5 = 65 worker "
                                         r"processes; one engine has at most 64 Ray ranks \(8 nodes of 8"):  # fmt: skip
        EngineArgs(distributed_executor="ray", tensor_parallel_size=13, pipeline_parallel_size=5)
    assert EngineArgs(distributed_executor="ray", placement_strategy="STRICT_SPREAD", tensor_parallel_size=8)
    strict = "= 9 worker processes with --placement-strategy STRICT_SPREAD: one rank per node, and the engine's step"
    with pytest.raises(ValueError, match=f"{strict} ring has a reader per node, at most 8"):
        EngineArgs(distributed_executor="ray", placement_strategy="STRICT_SPREAD", tensor_parallel_size=9)


def test_an_engine_placed_on_ray_needs_the_ray_executor_and_packs_at_most_eight_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pretend_ray_is_installed(monkeypatch)
    args = EngineArgs(distributed_executor="ray", engine_placement="ray", tensor_parallel_size=8)
    assert args.engine_placement == "ray" and EngineArgs.from_json(args.to_json()) == args
    with pytest.raises(ValueError, match="--engine-placement ray needs --distributed-executor ray"):
        EngineArgs(engine_placement="ray")
    with pytest.raises(ValueError, match=r"= 9 worker processes with --engine-placement ray: a replica's ranks are "
                                         "packed on its engine's node, at most 8"):  # fmt: skip
        EngineArgs(distributed_executor="ray", engine_placement="ray", tensor_parallel_size=9)
    with pytest.raises(ValueError, match="--engine-placement ray does not support --kv-transfer"):
        EngineArgs(distributed_executor="ray", engine_placement="ray", kv_transfer="shm")
    with pytest.raises(ValueError, match="--engine-placement 'remote': expected one of local, ray"):
        EngineArgs(engine_placement="remote")
