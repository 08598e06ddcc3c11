"""benchmarks/random_model.py writes a checkpoint that the real loaders and tokenizer take as they take any model."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "random_model.py"


def test_the_random_checkpoint_loads_and_runs_like_any_hf_folder(tmp_path, capsys):
    from ringserve.frontend.model_source import ModelNotFoundError, embedded_model_path
    from ringserve.frontend.text.tokenizer import load_tokenizer
    from ringserve.workers.loader import load_model
    from ringserve.workers.model_runner import ModelRunner
    from workers_testkit import NewRequest, ids, plan

    try:
        embedded_model_path()
    except ModelNotFoundError as exc:  # its tokenizer is the one written
        pytest.skip(str(exc))
    main = runpy.run_path(str(SCRIPT), run_name="random_model")["main"]
    assert main([str(tmp_path / "m"), "--shape", "toy", "--seed", "3"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["shape"] == "toy" and summary["bytes"] > 2 * summary["parameters"]  # bf16, plus the header
    tokenizer = load_tokenizer(tmp_path / "m")
    assert tokenizer.vocab_size == 49152 and tokenizer.chat_template is not None  # SmolLM2's, template included
    prompt = tokenizer.encode("The harbour town woke before the sun.")
    assert len(prompt) > 5 and tokenizer.decode(prompt).strip().startswith("The harbour")
    model = load_model(tmp_path / "m", torch.float32, "cpu")
    assert model.config.num_layers == 2 and model.config.vocab_size == 49152 and model.config.head_dim == 16
    weights = model.model.layers[1].mlp.down_proj.weight
    assert 0.015 < float(weights.std()) < 0.025 and float(model.model.norm.weight.min()) == 1.0
    runner = ModelRunner(model, block_size=16, num_kv_blocks=4)
    out = runner.execute(plan(0, [(0, 0, len(prompt), True)], new_requests=[NewRequest(0, ids(*prompt), ids(0, 1),
                                                                                       temperature=0.0)]))
    assert out.token_ids.shape == (1,) and 0 <= int(out.token_ids[0]) < 49152 and np.isfinite(out.logprobs).all()
