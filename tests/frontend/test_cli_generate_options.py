"""`ringserve generate` options for stop strings, n and cache_salt."""

from __future__ import annotations

import pytest
from frontend_testkit import COMPLETION, ScriptedEngine, completion_chunks, start_harness
from ringserve.frontend.api.validation import cache_salt_hash
from ringserve.frontend.text.tokenizer import ModelTokenizer
from test_cli import run_cli


async def test_generate_with_stop_n_and_cache_salt(tiny_tokenizer: ModelTokenizer,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    engine = ScriptedEngine(completion_chunks(tiny_tokenizer))
    h = await start_harness(tiny_tokenizer, engine)
    try:
        port = ["--port", str(h.server.port)]
        assert await run_cli(["generate", *port, "--stream", "--stop", "lo ", "--stop", "zz", "hello"]) == 0
        assert capsys.readouterr().out == "hel\n"
        assert await run_cli(["generate", *port, "--stop", "lo ", "--include-stop-str-in-output", "hello"]) == 0
        assert capsys.readouterr().out == "hello \n"
        assert await run_cli(["generate", *port, "--n", "2", "--seed", "5", "--cache-salt", "me", "hello"]) == 0
        assert capsys.readouterr().out == f"[0]\n{COMPLETION}\n[1]\n{COMPLETION}\n"
        seeds = sorted(params.seed for _, _, params in engine.submitted[-2:])
        assert seeds == [5, 6] and engine.submitted[-1][2].cache_salt == cache_salt_hash("me")
    finally:
        await h.channel.close()
        await h.server.stop(grace=None)
