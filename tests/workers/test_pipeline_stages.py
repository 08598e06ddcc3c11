"""Pipeline stages: where each rank sits, which layers a stage holds, and that a stage loads exactly its part.

The stages' outputs through real worker processes are tested in tests/integration/test_pipeline_parallel.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from ringserve.formats.engine_args import MAX_LOCAL_WORKERS
from ringserve.formats.rank_layout import RankLayout
from ringserve.workers.loader import load_model
from ringserve.workers.model import LlamaConfig
from ringserve.workers.pipeline import (
    HeadOnLastStage,
    HiddenFromPreviousStage,
    HiddenToNextStage,
    PipelineStage,
    split_layers,
    split_micro_batches,
)
from transformers import LlamaConfig as HfLlamaConfig
from transformers import LlamaForCausalLM as HfLlamaForCausalLM
from workers_testkit import TINY


def test_ranks_are_numbered_stage_by_stage_and_the_last_stage_writes_results() -> None:
    layout = RankLayout(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert layout.world_size == 6
    assert [layout.coords(r) for r in range(6)] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert layout.result_rank == 4
    assert layout.tensor_parallel_group(1) == [2, 3]
    assert layout.pipeline_group(1) == [1, 3, 5]
    first, middle, last = PipelineStage.of(layout, 1), PipelineStage.of(layout, 2), PipelineStage.of(layout, 5)
    assert (first.is_first, first.prev_rank, first.next_rank, first.last_rank) == (True, None, 3, 5)
    assert (middle.is_first, middle.is_last, middle.prev_rank, middle.next_rank) == (False, False, 0, 4)
    assert (last.is_last, last.prev_rank, last.next_rank) == (True, 3, None)
    with pytest.raises(ValueError, match="rank 6 is outside"):
        layout.coords(6)


def test_layers_split_into_contiguous_stages_with_the_extra_layers_first() -> None:
    assert split_layers(30, 2) == [range(0, 15), range(15, 30)]
    assert split_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert split_layers(2, 2) == [range(0, 1), range(1, 2)]


def test_more_stages_than_layers_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--pipeline-parallel-size 3 is larger than the model's 2 layers"):
        split_layers(2, 3)


def test_a_step_splits_into_micro_batches_of_whole_chunks_only_when_it_has_tokens_enough() -> None:
    def split(lens: list[int], stages: int) -> list[tuple[int, int]]:
        return [(s.start, s.stop) for s in split_micro_batches(np.array(lens), stages, min_tokens=64)]

    assert split([1] * 8, 2) == [(0, 8)]  # a decode step of few rows: one micro-batch
    assert split([300], 4) == [(0, 1)]  # one chunk is never cut
    assert split([1] * 200, 2) == [(0, 100), (100, 200)]
    assert split([1] * 200, 3) == [(0, 67), (67, 133), (133, 200)]
    assert split([64, 1, 1, 1, 64], 2) == [(0, 3), (3, 5)]
    assert split([100, 20], 2) == [(0, 2)]  # under 2 x 64 tokens: one micro-batch


def test_the_local_worker_limit_is_the_step_rings_reader_limit() -> None:
    from ringserve import _core

    assert MAX_LOCAL_WORKERS == _core.MAX_RING_READERS


def test_a_stage_config_keeps_its_layers_windows_and_expert_flags() -> None:
    full = LlamaConfig(100, 32, 64, 5, 4, 2, 8, layer_windows=(None, 8, None, 8, 4), num_experts=2,
                       num_experts_per_tok=1, moe_intermediate_size=16, moe_layers=(False, True, True, False, True),
                       tie_word_embeddings=True)  # fmt: skip
    first, last = PipelineStage.of(RankLayout(1, 2), 0), PipelineStage.of(RankLayout(1, 2), 1)
    local = last.local_config(full)
    assert (local.num_layers, local.layer_windows, local.moe_layers) == (2, (8, 4), (False, True))
    assert first.local_config(full).tie_word_embeddings and not local.tie_word_embeddings
    assert last.local_name("model.layers.3.mlp.gate.weight", full) == "model.layers.0.mlp.gate.weight"
    assert last.local_name("model.layers.2.mlp.gate.weight", full) is None
    assert last.local_name("model.embed_tokens.weight", full) == "lm_head.weight"  # the tied head's own copy
    assert first.local_name("model.norm.weight", full) is None and first.local_name("lm_head.weight", full) is None


@pytest.fixture(scope="module")
def three_layer_tied_llama(tmp_path_factory) -> tuple[Path, HfLlamaForCausalLM]:
    folder = tmp_path_factory.mktemp("llama3layers")
    torch.manual_seed(0)
    hf = HfLlamaForCausalLM(HfLlamaConfig(**{**TINY, "num_hidden_layers": 3}, tie_word_embeddings=True)).eval()
    hf.save_pretrained(folder)
    return folder, hf


def test_each_stage_loads_only_its_layers_and_ends(three_layer_tied_llama) -> None:
    folder, hf = three_layer_tied_llama
    full = load_model(folder, torch.float32)
    layout = RankLayout(1, 2)
    first = load_model(folder, torch.float32, stage=PipelineStage.of(layout, 0))
    last = load_model(folder, torch.float32, stage=PipelineStage.of(layout, 1))
    assert (len(first.model.layers), len(last.model.layers)) == (2, 1)
    assert first.config.num_layers == 2 and last.config.num_layers == 1  # the KV cache holds the stage's layers
    assert type(first.model.norm) is HiddenToNextStage and type(first.lm_head) is HeadOnLastStage
    assert type(last.model.embed_tokens) is HiddenFromPreviousStage
    expected = full.state_dict()
    for name, tensor in first.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    for name, tensor in last.state_dict().items():
        source = name.replace("model.layers.0.", "model.layers.2.")
        torch.testing.assert_close(tensor, expected[source], rtol=0, atol=0, msg=name)
    # The last stage's head is a copy of the tied embedding, not a view of a table this stage does not hold.
    torch.testing.assert_close(last.lm_head.weight, hf.model.embed_tokens.weight, rtol=0, atol=0)
    held = sum(p.numel() for m in (first, last) for p in m.parameters())
    assert held == sum(p.numel() for p in full.parameters()) + full.lm_head.weight.numel()


def test_a_model_with_fewer_layers_than_stages_is_refused_naming_the_flag(three_layer_tied_llama) -> None:
    folder, _ = three_layer_tied_llama
    with pytest.raises(ValueError, match="--pipeline-parallel-size 4 is larger than the model's 3 layers"):
        load_model(folder, torch.float32, stage=PipelineStage.of(RankLayout(1, 4), 0))
