"""ModelRunner: the persistent batch follows StepPlan deltas and samples exactly the planned rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ringserve.workers.loader import load_hf_model
from ringserve.workers.model_runner import ModelRunner, kv_blocks_for_memory
from workers_testkit import BlockAppend, NewRequest, hf_logits, ids, plan, save_tiny_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    hf = save_tiny_hf_model("llama", folder)
    return hf, folder


def make_runner(folder, **kwargs) -> ModelRunner:
    kwargs.setdefault("num_kv_blocks", 32)
    return ModelRunner(load_hf_model(folder, torch.float32), block_size=4, **kwargs)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def test_greedy_decode_of_two_requests_matches_transformers(tiny):
    hf, folder = tiny
    runner = make_runner(folder)
    p0, p1 = [5, 9, 200, 3, 17, 8], [250, 1, 2]
    out = runner.execute(
        plan(
            0,
            [(0, 0, 6, True), (3, 0, 3, True)],
            new_requests=[NewRequest(0, ids(*p0), ids(7, 2), temperature=0.0), NewRequest(3, ids(*p1), ids(11),
                                                                                          temperature=0.0)],
        )
    )
    assert out.slots.tolist() == [0, 3] and out.slots.dtype == np.int32 and out.token_ids.dtype == np.int32
    assert out.logprobs.dtype == np.float32 and (out.logprobs <= 0).all()
    got = {0: [int(out.token_ids[0])], 3: [int(out.token_ids[1])]}
    for step in range(1, 6):
        appends = []
        if len(p0) + step - 1 == 8:  # slot 0 crosses into a third block
            appends.append(BlockAppend(0, ids(20)))
        if len(p1) + step - 1 in (4, 8):
            appends.append(BlockAppend(3, ids(13 + step)))
        out = runner.execute(
            plan(step, [(0, len(p0) + step - 1, 1, True), (3, len(p1) + step - 1, 1, True)], block_appends=appends)
        )
        got[0].append(int(out.token_ids[0]))
        got[3].append(int(out.token_ids[1]))
    assert got[0] == hf_greedy(hf, p0, 6)
    assert got[3] == hf_greedy(hf, p1, 6)
    assert runner.tokens_of(0) == p0 + got[0]


def test_chunked_prefill_samples_only_after_the_last_chunk(tiny):
    hf, folder = tiny
    runner = make_runner(folder)
    prompt = list(range(10, 21))
    first = runner.execute(plan(0, [(1, 0, 6, False)], new_requests=[NewRequest(1, ids(*prompt), ids(4, 9),
                                                                                temperature=0.0)]))
    assert first.slots.size == 0 and first.token_ids.size == 0
    second = runner.execute(plan(1, [(1, 6, 5, True)], block_appends=[BlockAppend(1, ids(0))]))
    assert second.slots.tolist() == [1]
    assert int(second.token_ids[0]) == hf_greedy(hf, prompt, 1)[0]


def test_finished_slot_is_dropped_and_can_be_reused_in_the_same_plan(tiny):
    hf, folder = tiny
    runner = make_runner(folder)
    runner.execute(plan(0, [(2, 0, 4, True)], new_requests=[NewRequest(2, ids(1, 2, 3, 4), ids(0, 1),
                                                                       temperature=0.0)]))
    assert runner.batch.occupied[2]
    runner.execute(plan(1, [], finished_slots=ids(2)))
    assert not runner.batch.occupied[2]
    with pytest.raises(ValueError, match="slot 2"):
        runner.execute(plan(2, [(2, 4, 1, True)]))

    runner.execute(plan(3, [(5, 0, 2, True)], new_requests=[NewRequest(5, ids(9, 9), ids(6), temperature=0.0)]))
    reused = [7, 100, 42]
    # Slot 5 finishes and a new request takes it in the same plan, reusing its blocks.
    out = runner.execute(
        plan(4, [(5, 0, 3, True)], finished_slots=ids(5), new_requests=[NewRequest(5, ids(*reused), ids(6),
                                                                                   temperature=0.0)])
    )
    assert runner.tokens_of(5)[:3] == reused
    assert int(out.token_ids[0]) == hf_greedy(hf, reused, 1)[0]


def test_new_request_into_an_occupied_slot_is_an_error(tiny):
    _, folder = tiny
    runner = make_runner(folder)
    runner.execute(plan(0, [], new_requests=[NewRequest(1, ids(1, 2), ids(0), temperature=0.0)]))
    with pytest.raises(ValueError, match="slot 1"):
        runner.execute(plan(1, [], new_requests=[NewRequest(1, ids(3), ids(1), temperature=0.0)]))


def test_block_appends_extend_the_block_table_and_are_bounds_checked(tiny):
    _, folder = tiny
    runner = make_runner(folder, num_kv_blocks=8)
    runner.execute(plan(0, [], new_requests=[NewRequest(0, ids(1, 2, 3, 4, 5), ids(3), temperature=0.0)]))
    with pytest.raises(ValueError, match="need 2 blocks"):
        runner.execute(plan(1, [(0, 0, 5, True)]))
    runner.execute(plan(2, [], block_appends=[BlockAppend(0, ids(6))]))
    assert runner.batch.block_table[0, : runner.batch.num_blocks[0]].tolist() == [3, 6]
    with pytest.raises(ValueError, match="out of range"):
        runner.execute(plan(3, [], block_appends=[BlockAppend(0, ids(8))]))


def test_resumed_request_recomputes_prompt_plus_outputs(tiny):
    """Preemption by recompute: the engine re-adds the slot with every known token."""
    hf, folder = tiny
    runner = make_runner(folder)
    tokens = [3, 1, 4, 1, 5, 9, 2]
    out = runner.execute(plan(0, [(4, 0, 7, True)], new_requests=[NewRequest(4, ids(*tokens), ids(1, 0),
                                                                             temperature=0.0)]))
    assert int(out.token_ids[0]) == hf_greedy(hf, tokens, 1)[0]


def test_seeded_request_samples_reproducibly_across_runners(tiny):
    _, folder = tiny

    def run(seed: int, runner_seed: int) -> list[int]:
        runner = make_runner(folder, seed=runner_seed)
        req = NewRequest(0, ids(7, 8, 9), ids(0, 1, 2), temperature=1.0, seed=seed, has_seed=True)
        out = [int(runner.execute(plan(0, [(0, 0, 3, True)], new_requests=[req])).token_ids[0])]
        for step in range(1, 8):
            out.append(int(runner.execute(plan(step, [(0, 2 + step, 1, True)])).token_ids[0]))
        return out

    assert run(seed=1234, runner_seed=0) == run(seed=1234, runner_seed=77)
    assert run(seed=1234, runner_seed=0) != run(seed=4321, runner_seed=0)


def test_kv_cache_is_sized_from_the_memory_budget(tiny):
    _, folder = tiny
    runner = make_runner(folder, num_kv_blocks=None, kv_cache_memory_gib=0.001)
    # 2 layers * (K + V) * 4 tokens * 2 kv heads * 16 dims * 4 bytes = 2048 bytes per block.
    assert runner.config.kv_bytes_per_block(4, torch.float32) == 2048
    assert runner.num_kv_blocks == int(0.001 * (1 << 30)) // 2048
    assert runner.kv_cache.k[0].shape == (runner.num_kv_blocks, 4, 2, 16)
    with pytest.raises(ValueError, match="kv_cache_memory_gib"):
        kv_blocks_for_memory(runner.config, 4, torch.float32, 1e-9)


# ---- layout version 2 fields through the persistent batch --------------------------------------------------------


def seeded_tokens(runner: ModelRunner, prompt: list[int], seed: int, steps: int, neighbours: int) -> list[int]:
    """A seeded request in slot 0 decoding beside `neighbours` other sampling requests."""
    others = [
        NewRequest(1 + i, ids(*prompt[: 2 + i]), ids(10 + 2 * i, 11 + 2 * i), temperature=1.5)
        for i in range(neighbours)
    ]
    req = NewRequest(0, ids(*prompt), ids(0, 1), temperature=1.0, seed=seed, has_seed=True, top_k=50)
    sched = [(0, 0, len(prompt), True)] + [(1 + i, 0, 2 + i, True) for i in range(neighbours)]
    out = runner.execute(plan(0, sched, new_requests=[req, *others]))
    got = [int(out.token_ids[0])]
    for step in range(1, steps):
        sched = [(0, len(prompt) + step - 1, 1, True)] + [(1 + i, 1 + i + step, 1, True) for i in range(neighbours)]
        got.append(int(runner.execute(plan(step, sched)).token_ids[0]))
    return got


def test_seeded_request_gives_the_same_tokens_alone_or_batched(tiny):
    _, folder = tiny
    prompt = [7, 8, 9, 10]
    alone = seeded_tokens(make_runner(folder, seed=0), prompt, seed=99, steps=4, neighbours=0)
    assert seeded_tokens(make_runner(folder, seed=5), prompt, seed=99, steps=4, neighbours=3) == alone


def test_resumed_seeded_request_continues_its_stream(tiny):
    """After preemption the engine re-adds prompt + outputs; the next draw must be the one it would have made."""
    _, folder = tiny
    prompt = [7, 8, 9, 10]
    straight = seeded_tokens(make_runner(folder), prompt, seed=3, steps=4, neighbours=0)
    runner = make_runner(folder)
    known = prompt + straight[:3]
    req = NewRequest(2, ids(*known), ids(5, 6), temperature=1.0, seed=3, has_seed=True, top_k=50,
                     num_prompt_tokens=len(prompt))  # fmt: skip
    out = runner.execute(plan(0, [(2, 0, len(known), True)], new_requests=[req]))
    assert int(out.token_ids[0]) == straight[3]


def test_min_tokens_keeps_suppressed_ids_out_until_reached(tiny):
    hf, folder = tiny
    prompt = [3, 4, 5]
    greedy_first = hf_greedy(hf, prompt, 1)[0]
    runner = make_runner(folder)
    req = NewRequest(0, ids(*prompt), ids(0), min_tokens=1, suppress_token_ids=ids(greedy_first), temperature=0.0)
    out = runner.execute(plan(0, [(0, 0, 3, True)], new_requests=[req]))
    assert int(out.token_ids[0]) != greedy_first


@pytest.mark.parametrize(
    ("knob", "fast"),
    [
        ({}, True),
        ({"temperature": 1e-6}, True),
        ({"min_tokens": 1, "suppress_token_ids": ids(7)}, False),  # suppression active at the first token only
        ({"repetition_penalty": 1.3}, False),
        ({"presence_penalty": 0.5}, False),
        ({"num_logprobs": 2}, False),
        ({"temperature": 0.8, "seed": 3, "has_seed": True}, False),
    ],
)
def test_plain_greedy_rows_skip_the_sampling_batch_and_match_the_full_sampler(tiny, monkeypatch, knob, fast):
    """A step whose rows are all greedy with nothing to adjust takes Sampler.greedy (no SamplingBatch is built);
    any knob that changes the token or the output sends the step through Sampler.sample; both give the tokens and
    log-probabilities the full sampler gives."""
    _, folder = tiny
    runner = make_runner(folder)
    full = make_runner(folder)
    built = []
    real = runner.batch.sampling_batch
    monkeypatch.setattr(runner.batch, "sampling_batch", lambda slots: built.append(slots.tolist()) or real(slots))
    full.batch.plain_greedy = lambda slots: False  # always the full sampler
    reqs = [NewRequest(0, ids(5, 9, 200), ids(0), temperature=0.0), NewRequest(1, ids(3, 4), ids(1),
                                                                               **{"temperature": 0.0, **knob})]
    first = plan(0, [(0, 0, 3, True), (1, 0, 2, True)], new_requests=reqs)
    second = plan(1, [(0, 3, 1, True), (1, 2, 1, True)])
    steps = [(runner.execute(p), full.execute(p)) for p in (first, second)]
    for got, want in steps:
        assert got.token_ids.tolist() == want.token_ids.tolist()
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-6, atol=1e-6)
    if fast:
        assert built == []
    elif "min_tokens" in knob:
        assert built == [[0, 1]]  # min_tokens=1 is reached after the first token: the second step is plain again
    else:
        assert built == [[0, 1], [0, 1]]


def test_top_logprobs_come_back_for_rows_that_ask(tiny):
    _, folder = tiny
    runner = make_runner(folder)
    reqs = [NewRequest(0, ids(1, 2), ids(0), num_logprobs=3, temperature=0.0), NewRequest(1, ids(3, 4), ids(1),
                                                                                          temperature=0.0)]
    out = runner.execute(plan(0, [(0, 0, 2, True), (1, 0, 2, True)], new_requests=reqs))
    assert out.top_token_ids is not None and out.top_token_ids.shape == (2, 3)
    assert out.top_token_ids.dtype == np.int32 and out.top_logprobs.dtype == np.float32
    assert int(out.top_token_ids[0, 0]) == int(out.token_ids[0])  # greedy: the top alternative is the token
    assert out.top_token_ids[1].tolist() == [-1, -1, -1]


def test_bfloat16_kv_cache_under_float32_weights(tiny):
    hf, folder = tiny
    runner = make_runner(folder, kv_cache_dtype=torch.bfloat16)
    assert runner.kv_cache.k[0].dtype == torch.bfloat16
    prompt = [5, 9, 200, 3]
    out = runner.execute(plan(0, [(0, 0, 4, True)], new_requests=[NewRequest(0, ids(*prompt), ids(0),
                                                                             temperature=0.0)]))
    assert int(out.token_ids[0]) == hf_greedy(hf, prompt, 1)[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_runner_decodes_like_the_cpu_runner(tiny):
    hf, folder = tiny
    runner = ModelRunner(load_hf_model(folder, torch.float32, "cuda"), block_size=4, num_kv_blocks=32, device="cuda")
    prompt = [5, 9, 200, 3, 17]
    out = runner.execute(plan(0, [(0, 0, 5, True)], new_requests=[NewRequest(0, ids(*prompt), ids(0, 1),
                                                                             temperature=0.0)]))
    assert int(out.token_ids[0]) == hf_greedy(hf, prompt, 1)[0]
