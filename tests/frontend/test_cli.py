"""`ringserve generate` and friends against an in-process server; RINGSERVE_* environment defaults."""

from __future__ import annotations

import asyncio
import json

import pytest
from frontend_testkit import ScriptedEngine
from ringserve.formats.cli_env import env_default, env_name, parse_bool
from ringserve.frontend import cli
from ringserve.frontend.text.tokenizer import ModelTokenizer
from test_server import COMPLETION, completion_chunks, start_harness


def test_env_default_reads_ringserve_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_name("--max-num-seqs") == "RINGSERVE_MAX_NUM_SEQS"
    assert env_default("--port", 50051, int) == 50051
    monkeypatch.setenv("RINGSERVE_PORT", "6000")
    assert env_default("--port", 50051, int) == 6000
    monkeypatch.setenv("RINGSERVE_STREAM", "yes")
    assert env_default("STREAM", False, parse_bool) is True
    monkeypatch.setenv("RINGSERVE_PORT", "sixty")
    with pytest.raises(ValueError, match="RINGSERVE_PORT"):
        env_default("--port", 50051, int)


async def run_cli(argv: list[str]) -> int:
    # The CLI uses a blocking channel; run it off the loop that serves the in-process server.
    return await asyncio.to_thread(cli.main, argv)


async def test_generate_streams_text_to_stdout(tiny_tokenizer: ModelTokenizer, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    engine = ScriptedEngine(completion_chunks(tiny_tokenizer))
    h = await start_harness(tiny_tokenizer, engine)
    try:
        monkeypatch.setenv("RINGSERVE_PORT", str(h.server.port))  # the port comes from the environment
        assert await run_cli(["generate", "--stream", "--max-tokens", "5", "--temperature", "0", "hello"]) == 0
        assert capsys.readouterr().out == COMPLETION + "\n"
        _, prompt, params = engine.submitted[-1]
        assert prompt == tiny_tokenizer.encode_chat([{"role": "user", "content": "hello"}])
        assert (params.max_tokens, params.sampling.temperature) == (5, 0.0)
        assert await run_cli(["generate", "--raw", "--seed", "3", "--ignore-eos", "hello"]) == 0
        assert capsys.readouterr().out == COMPLETION + "\n"
        _, prompt, params = engine.submitted[-1]
        assert prompt == tiny_tokenizer.encode("hello") and params.seed == 3 and params.ignore_eos
    finally:
        await h.channel.close()
        await h.server.stop(grace=None)


async def test_generate_reports_rpc_errors_on_stderr(tiny_tokenizer: ModelTokenizer,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    h = await start_harness(tiny_tokenizer, ScriptedEngine(completion_chunks(tiny_tokenizer)))
    try:
        code = await run_cli(["generate", "--port", str(h.server.port), "--max-tokens", "0", "hello"])
        assert code == 1
        err = capsys.readouterr().err
        assert "INVALID_ARGUMENT" in err and "max_tokens" in err
    finally:
        await h.channel.close()
        await h.server.stop(grace=None)


async def test_tokenize_and_model_info_subcommands(tiny_tokenizer: ModelTokenizer,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    h = await start_harness(tiny_tokenizer, ScriptedEngine(completion_chunks(tiny_tokenizer)))
    port = str(h.server.port)
    try:
        assert await run_cli(["tokenize", "--port", port, "hello"]) == 0
        assert capsys.readouterr().out.split() == [str(i) for i in tiny_tokenizer.encode("hello")]
        assert await run_cli(["model-info", "--port", port]) == 0
        assert json.loads(capsys.readouterr().out)["model"] == "tiny"
        assert await run_cli(["stats", "--port", port]) == 0
        assert json.loads(capsys.readouterr().out)["num_running"] == 2
    finally:
        await h.channel.close()
        await h.server.stop(grace=None)


def test_bad_environment_value_is_reported(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RINGSERVE_MAX_TOKENS", "many")
    assert cli.main(["generate", "hi"]) == 2
    assert "RINGSERVE_MAX_TOKENS" in capsys.readouterr().err


@pytest.mark.parametrize(("gpu", "cpu_bf16", "expected"), [
    (False, False, "float32"), (False, True, "bfloat16"), (True, False, "bfloat16"), (True, True, "bfloat16"),
])  # fmt: skip
def test_dtype_auto_is_bf16_where_bf16_is_fast(monkeypatch: pytest.MonkeyPatch, gpu: bool, cpu_bf16: bool,
                                               expected: str) -> None:  # fmt: skip
    from ringserve.backend import engine_process

    monkeypatch.setattr(engine_process, "nvidia_gpu_present", lambda: gpu)
    monkeypatch.setattr(engine_process, "native_bf16_cpu", lambda: cpu_bf16)
    assert engine_process.resolve_dtype("auto") == expected
    for explicit in ("float32", "bfloat16", "float16"):
        assert engine_process.resolve_dtype(explicit) == explicit
