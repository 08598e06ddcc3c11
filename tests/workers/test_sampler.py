"""Batch sampler: greedy, top-k, top-p, per-request seeds, raw-logit logprobs, and the sampled distribution."""

from __future__ import annotations

import pytest
import torch
from ringserve.workers.sampler import Sampler, SamplingBatch


def batch(rows: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seeds=None) -> SamplingBatch:
    return SamplingBatch.build([temperature] * rows, [top_k] * rows, [top_p] * rows, seeds)


def random_logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax_with_raw_logprobs():
    logits = random_logits()
    tokens, logprobs = Sampler()(logits, batch(4, temperature=0.0))
    assert tokens.tolist() == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected)


def test_top_k_one_is_greedy_even_at_high_temperature():
    logits = random_logits(rows=8)
    sampler = Sampler(torch.Generator().manual_seed(5))
    for _ in range(20):
        tokens, _ = sampler(logits, batch(8, temperature=5.0, top_k=1))
        assert tokens.tolist() == logits.argmax(-1).tolist()


def test_logprobs_are_of_the_raw_logits_not_the_tempered_distribution():
    logits = random_logits(rows=2)
    tokens, logprobs = Sampler(torch.Generator().manual_seed(1))(logits, batch(2, temperature=3.0, top_k=5))
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected)


def test_seeded_rows_are_reproducible_and_independent_of_the_rest_of_the_batch():
    logits = random_logits(rows=3, vocab=1000)

    def draws(seed: int, neighbours_seed: int) -> list[int]:
        sampler = Sampler(torch.Generator().manual_seed(neighbours_seed))
        out = []
        for step in range(10):
            b = batch(3, temperature=1.5, seeds=[None, seed, None])
            b.output_index = torch.tensor([0, step, 0])
            tokens, _ = sampler(logits, b)
            out.append(int(tokens[1]))
        return out

    assert draws(seed=42, neighbours_seed=0) == draws(seed=42, neighbours_seed=99)
    assert draws(seed=42, neighbours_seed=0) != draws(seed=43, neighbours_seed=0)


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = random_logits(rows=4, vocab=100)
    temps = SamplingBatch.build([0.0, 2.0, 0.0, 2.0], [0] * 4, [1.0] * 4)
    sampler = Sampler(torch.Generator().manual_seed(3))
    seen_row1 = set()
    for _ in range(30):
        tokens, _ = sampler(logits, temps)
        assert int(tokens[0]) == int(logits[0].argmax()) and int(tokens[2]) == int(logits[2].argmax())
        seen_row1.add(int(tokens[1]))
    assert len(seen_row1) > 1


def test_top_p_only_samples_from_the_smallest_set_reaching_p():
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps the first two (0.5 < 0.75 <= 0.8).
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]])).repeat(2000, 1)
    tokens, _ = Sampler(torch.Generator().manual_seed(0))(logits, batch(2000, top_p=0.75))
    assert set(tokens.tolist()) == {1, 3}
    # Renormalised 0.5 / 0.8 = 0.625 for token 1 (binomial sd ~ 0.011).
    assert abs((tokens == 1).float().mean().item() - 0.625) < 0.06


def test_top_k_only_samples_from_the_k_most_likely():
    logits = random_logits(rows=1, vocab=30).repeat(3000, 1)
    tokens, _ = Sampler(torch.Generator().manual_seed(0))(logits, batch(3000, temperature=2.0, top_k=3))
    assert set(tokens.tolist()) <= set(logits[0].topk(3).indices.tolist())
    assert len(set(tokens.tolist())) == 3


def test_sampled_frequencies_match_the_softmax_at_temperature():
    torch.manual_seed(0)
    logits = torch.randn(1, 8).repeat(20000, 1)
    temperature = 0.7
    tokens, _ = Sampler(torch.Generator().manual_seed(11))(logits, batch(20000, temperature=temperature))
    observed = torch.bincount(tokens, minlength=8).float() / 20000
    expected = torch.softmax(logits[0] / temperature, -1)
    # 20000 draws: each frequency's sd <= 0.0036; allow ~5 sd.
    assert (observed - expected).abs().max().item() < 0.02


# ---- layout version 2: min-p, penalties, min_tokens, seeds, top-n logprobs ---------------------------------------


def reference_distribution(logits: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The definitions, one row at a time: softmax(l / T); drop p < min_p * max p; keep the k most likely; keep the
    smallest most-likely prefix whose mass reaches top_p; renormalise."""
    probs = torch.softmax(logits.double() / t, -1)
    keep = probs >= min_p * probs.max()
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
    kept = [i for i in order if keep[i]]
    if top_k > 0:
        kept = kept[:top_k]
    total = sum(float(probs[i]) for i in kept)
    chosen, mass = [], 0.0
    for i in kept:
        if mass >= top_p:
            break
        chosen.append(i)
        mass += float(probs[i]) / total
    out = torch.zeros_like(probs)
    out[chosen] = probs[chosen]
    return out / out.sum()


def test_min_p_top_k_top_p_masks_are_exactly_the_definition():
    from ringserve.workers.sampler import sampling_distribution

    logits = random_logits(rows=6, vocab=40, seed=3)
    params = [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.6, 0.0), (1.0, 0, 1.0, 0.1), (0.9, 8, 0.8, 0.05),
              (2.0, 1, 1.0, 0.0)]  # fmt: skip
    b = SamplingBatch.build([p[0] for p in params], [p[1] for p in params], [p[2] for p in params])
    b.min_p = torch.tensor([p[3] for p in params])
    got = sampling_distribution(logits, b)
    for row, (t, k, p, mp) in enumerate(params):
        expected = reference_distribution(logits[row], t, k, p, mp)
        assert torch.equal(got[row] > 0, expected > 0), f"row {row}: support differs"
        torch.testing.assert_close(got[row].double(), expected, atol=1e-6, rtol=1e-5)


def test_min_p_never_samples_a_token_below_its_floor():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]])).repeat(4000, 1)
    b = batch(4000)
    b.min_p = torch.full((4000,), 0.2)  # floor 0.1: token 3 (0.08) is out, token 2 (0.12) stays
    tokens, _ = Sampler(torch.Generator().manual_seed(0))(logits, b)
    assert set(tokens.tolist()) == {0, 1, 2}


def reference_penalties(logits: torch.Tensor, history: list[int], prompt_len: int, rep: float, freq: float,
                        pres: float) -> torch.Tensor:  # fmt: skip
    out = logits.clone()
    outputs = history[prompt_len:]
    for token in set(history):
        out[token] = out[token] / rep if out[token] > 0 else out[token] * rep
    for token in set(outputs):
        out[token] -= freq * outputs.count(token) + pres
    return out


def test_repetition_frequency_presence_penalties_equal_the_reference():
    from ringserve.workers.sampler import apply_penalties

    logits = random_logits(rows=3, vocab=20, seed=7)
    histories = [[1, 2, 3, 3, 5, 5, 5], [4, 4, 9], [0, 19, 7, 7]]
    prompt_lens = [3, 1, 4]  # row 2 has no outputs yet: only the repetition penalty applies
    rep, freq, pres = [1.3, 1.0, 2.0], [0.5, 0.25, 1.0], [0.7, 0.0, 3.0]
    b = batch(3)
    width = max(map(len, histories))
    b.token_ids = torch.tensor([h + [-1] * (width - len(h)) for h in histories])
    b.num_tokens = torch.tensor([len(h) for h in histories])
    b.num_prompt_tokens = torch.tensor(prompt_lens)
    b.repetition_penalty, b.frequency_penalty, b.presence_penalty = map(torch.tensor, (rep, freq, pres))
    got = apply_penalties(logits, b)
    for row in range(3):
        expected = reference_penalties(logits[row], histories[row], prompt_lens[row], rep[row], freq[row], pres[row])
        torch.testing.assert_close(got[row], expected)


def test_min_tokens_suppresses_stop_ids_only_while_active():
    logits = torch.zeros(2, 10)
    logits[:, 4] = 10.0  # the stop token would win greedily
    b = batch(2, temperature=0.0)
    b.suppress_token_ids = torch.tensor([[4, 2], [4, -1]])
    b.suppress_active = torch.tensor([True, False])
    tokens, logprobs = Sampler()(logits, b)
    assert int(tokens[0]) != 4 and int(tokens[1]) == 4
    # Logprobs stay those of the raw model distribution.
    torch.testing.assert_close(logprobs[0], torch.log_softmax(logits[0], -1)[tokens[0]])


def seeded_row_token(logits_row: torch.Tensor, seed: int, output_index: int, neighbours: int) -> int:
    """Samples the seeded row placed in the middle of `neighbours` other rows of various kinds."""
    rows = neighbours + 1
    others = random_logits(rows=rows, vocab=logits_row.shape[0], seed=99 + neighbours)
    others[neighbours // 2] = logits_row
    seeds = [None if i % 2 else 1000 + i for i in range(rows)]
    seeds[neighbours // 2] = seed
    b = SamplingBatch.build([1.0 + 0.1 * i for i in range(rows)], [0] * rows, [1.0] * rows, seeds)
    b.temperature[neighbours // 2] = 1.0
    b.output_index = torch.tensor([(output_index if i == neighbours // 2 else 7 * i) for i in range(rows)])
    tokens, _ = Sampler(torch.Generator().manual_seed(neighbours))(others, b)
    return int(tokens[neighbours // 2])


def test_seeded_output_is_the_same_alone_or_in_any_batch():
    row = random_logits(rows=1, vocab=500, seed=4)[0]
    for index in range(6):
        alone = seeded_row_token(row, seed=2024, output_index=index, neighbours=0)
        assert seeded_row_token(row, 2024, index, neighbours=3) == alone
        assert seeded_row_token(row, 2024, index, neighbours=8) == alone
    draws = {seeded_row_token(row, 2024, i, 0) for i in range(12)}
    assert len(draws) > 1, "the seeded stream must advance with the output index"


def test_seeded_draws_follow_the_distribution():
    """Counter-based seeded noise must still sample softmax exactly: 20000 different seeds, one row each."""
    torch.manual_seed(1)
    logits = torch.randn(1, 8).repeat(20000, 1)
    b = SamplingBatch.build([0.8] * 20000, [0] * 20000, [1.0] * 20000, list(range(20000)))
    b.output_index = torch.full((20000,), 3)
    tokens, _ = Sampler()(logits, b)
    observed = torch.bincount(tokens, minlength=8).float() / 20000
    assert (observed - torch.softmax(logits[0] / 0.8, -1)).abs().max().item() < 0.02


def test_top_n_logprobs_are_the_raw_top_alternatives_padded_per_row():
    logits = random_logits(rows=3, vocab=30, seed=5)
    b = batch(3, temperature=0.0)
    b.num_logprobs = torch.tensor([3, 0, 1])
    out = Sampler().sample(logits, b)
    raw = torch.log_softmax(logits, -1)
    values, ids = raw.topk(3, -1)
    assert out.top_token_ids.shape == (3, 3) and out.top_token_ids.dtype == torch.int32
    assert out.top_token_ids[0].tolist() == ids[0].tolist()
    torch.testing.assert_close(out.top_logprobs[0], values[0])
    assert out.top_token_ids[1].tolist() == [-1, -1, -1]
    assert out.top_token_ids[2].tolist() == [int(ids[2, 0]), -1, -1]
    b.num_logprobs = torch.zeros(3, dtype=torch.int64)
    assert Sampler().sample(logits, b).top_token_ids is None


def test_plain_greedy_batches_take_the_native_pass_and_equal_pytorch(monkeypatch) -> None:
    from ringserve.workers import sampler as sampler_module
    from ringserve.workers.model import cpu_ops

    calls: list[tuple[int, ...]] = []
    real = sampler_module.greedy_tokens

    def recording(logits: torch.Tensor):
        calls.append(tuple(logits.shape))
        return real(logits)

    monkeypatch.setattr(sampler_module, "greedy_tokens", recording)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (random_logits(rows=16, vocab=5003, seed=3) * 2).to(dtype)
        logits[5, 100] = logits[5, 4000] = logits[5].max() + 1  # a tie: the first index wins, as in torch
        out = Sampler().sample(logits, batch(16, temperature=0.0))
        assert out.token_ids.tolist() == logits.float().argmax(-1).tolist()
        assert out.token_ids[5] == 100 and out.top_token_ids is None
        expected = torch.log_softmax(logits.float(), -1).gather(1, out.token_ids[:, None]).squeeze(1)
        torch.testing.assert_close(out.logprobs, expected, rtol=1e-5, atol=1e-5)
    if cpu_ops.native_attention_available():  # built with the kernels (else the same answers come from PyTorch)
        assert calls == [(16, 5003)] * 2
    # Anything that adjusts the logits, samples or wants alternatives takes the tensor path.
    calls.clear()
    logits = random_logits(rows=2)
    Sampler().sample(logits, batch(2, temperature=0.7))
    Sampler().sample(logits, SamplingBatch.build([0.0] * 2, [0] * 2, [1.0] * 2, num_logprobs=torch.tensor([0, 2])))
    assert calls == []


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_seeded_noise_is_its_definition_at_any_batch_size_and_thread_count(monkeypatch) -> None:
    # The seeded stream is part of what a seed means (the same seed gives the same output across releases): each value
    # is -log((h + 0.5) / 2**32), h the double lowbias32 hash of (seed, output index, vocab id), computed here with
    # Python integers; the numpy version must give the same float32 bits however the rows are split over threads.
    import math

    import numpy as np
    from ringserve.workers import sampler as sampler_module

    seeds = [0, 1, 2**40 + 17, -(2**62) + 5, 2**63 - 1]
    index = [0, 3, 7, 1 << 30, 2**31 + 9]

    def expected(seed: int, out_index: int, vocab_id: int) -> float:
        seed &= (1 << 64) - 1
        key = _lowbias32(_lowbias32((seed & 0xFFFFFFFF) ^ _lowbias32(seed >> 32)) ^ (out_index & 0xFFFFFFFF))
        first = _lowbias32((vocab_id * 0x9E3779B1 + key) & 0xFFFFFFFF)
        bits = _lowbias32(first ^ _lowbias32(key ^ 0x85EBCA6B))
        return float(np.float32(-math.log((bits + 0.5) / 4294967296.0)))

    vocab = 3000
    for parallel_from in (1 << 40, 1):  # one thread, then rows split over threads
        monkeypatch.setattr(sampler_module, "_PARALLEL_NOISE_VALUES", parallel_from)
        noise = sampler_module.seeded_exponential(torch.tensor(seeds), torch.tensor(index), vocab)
        assert noise.shape == (len(seeds), vocab) and noise.dtype == torch.float32
        for r, (seed, out_index) in enumerate(zip(seeds, index, strict=True)):
            for v in (0, 1, 2, 1234, vocab - 1):
                assert noise[r, v].item() == expected(seed, out_index, v), (seed, out_index, v)
        alone = sampler_module.seeded_exponential(torch.tensor(seeds[2:3]), torch.tensor(index[2:3]), vocab)
        assert torch.equal(alone[0], noise[2])
    # The torch-ops version (what a GPU runs) computes the same function.
    on_device = sampler_module._seeded_exponential_tensor(torch.tensor(seeds), torch.tensor(index), vocab)
    assert torch.equal(on_device, noise)
    assert (noise > 0).all() and abs(noise.mean().item() - 1.0) < 0.05  # Exp(1)


# ---- CUDA: the sampler on a GPU's tensors (skipped without one) ------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def full_batch(rows: int, vocab: int, device: str, seeds: list[int | None]) -> SamplingBatch:
    """Every knob in use somewhere: temperature, top-k, top-p, min-p, the three penalties, min_tokens
    suppression, top-n logprobs, greedy rows among sampled ones."""
    gen = torch.Generator().manual_seed(rows)
    b = SamplingBatch.build([0.0 if r % 5 == 4 else 0.6 + 0.15 * r for r in range(rows)],
                            [(0, 40, 0, 7)[r % 4] for r in range(rows)], [(1.0, 0.9, 0.7)[r % 3] for r in range(rows)],
                            seeds, device=device)  # fmt: skip
    b.min_p = torch.tensor([(0.0, 0.05)[r % 2] for r in range(rows)], device=device)
    b.output_index = torch.arange(rows, device=device) * 3
    history = torch.randint(0, vocab, (rows, 24), generator=gen)
    history[:, 20:] = -1
    b.token_ids = history.to(device)
    b.num_tokens = torch.full((rows,), 20, device=device)
    b.num_prompt_tokens = torch.full((rows,), 12, device=device)
    b.repetition_penalty = torch.tensor([(1.0, 1.3)[r % 2] for r in range(rows)], device=device)
    b.frequency_penalty = torch.tensor([(0.0, 0.4, 0.2)[r % 3] for r in range(rows)], device=device)
    b.presence_penalty = torch.tensor([(0.5, 0.0)[r % 2] for r in range(rows)], device=device)
    b.suppress_token_ids = torch.tensor([[1, 2]] * rows, device=device)
    b.suppress_active = torch.tensor([r % 3 == 0 for r in range(rows)], device=device)
    b.num_logprobs = torch.tensor([r % 4 for r in range(rows)], device=device)
    return b


@needs_cuda
def test_cuda_seeded_rows_sample_what_the_cpu_samples():
    # A seed means the same tokens on either device: the noise is one function of (seed, output index, vocab id),
    # and every mask and penalty is elementwise or per row.
    rows, vocab = 24, 32000
    logits = random_logits(rows=rows, vocab=vocab, seed=21)
    seeds = [7919 * r - 2**40 for r in range(rows)]
    cpu = Sampler(torch.Generator().manual_seed(0)).sample(logits, full_batch(rows, vocab, "cpu", seeds))
    gpu = Sampler(torch.Generator("cuda").manual_seed(0)).sample(logits.cuda(), full_batch(rows, vocab, "cuda", seeds))
    assert gpu.token_ids.device.type == "cuda"
    assert gpu.token_ids.cpu().tolist() == cpu.token_ids.tolist()
    torch.testing.assert_close(gpu.logprobs.cpu(), cpu.logprobs, atol=1e-4, rtol=1e-5)
    assert gpu.top_token_ids is not None and cpu.top_token_ids is not None and gpu.top_logprobs is not None
    assert gpu.top_token_ids.cpu().tolist() == cpu.top_token_ids.tolist()
    torch.testing.assert_close(gpu.top_logprobs.cpu(), cpu.top_logprobs, atol=1e-4, rtol=1e-5)


@needs_cuda
def test_cuda_seeded_noise_equals_the_cpu_noise():
    from ringserve.workers.sampler import seeded_exponential

    seeds, index = torch.tensor([0, 5, 2**40 + 17, -(2**62) + 5, 2**63 - 1]), torch.tensor([0, 3, 7, 1 << 30, 9])
    cpu = seeded_exponential(seeds, index, 128256)
    gpu = seeded_exponential(seeds.cuda(), index.cuda(), 128256)
    assert gpu.device.type == "cuda"
    # The same float64 log on both sides; a last-bit difference in a libm may round one float32 apart.
    torch.testing.assert_close(gpu.cpu(), cpu, atol=0, rtol=2e-7)


@needs_cuda
@pytest.mark.parametrize("seeded", [False, True], ids=["generator", "seeds"])
def test_cuda_sampled_frequencies_match_the_masked_softmax(seeded):
    # 20000 draws of one row on the GPU, through top-k and min-p: the frequencies of the reference distribution.
    torch.manual_seed(2)
    row = torch.randn(12)
    b = SamplingBatch.build([0.8] * 20000, [6] * 20000, [1.0] * 20000, list(range(20000)) if seeded else None,
                            device="cuda")  # fmt: skip
    b.min_p = torch.full((20000,), 0.1, device="cuda")
    tokens, _ = Sampler(torch.Generator("cuda").manual_seed(3))(row.repeat(20000, 1).cuda(), b)
    observed = torch.bincount(tokens.cpu(), minlength=12).double() / 20000
    expected = reference_distribution(row, 0.8, 6, 1.0, 0.1)
    assert torch.equal(observed > 0, expected > 0)
    assert (observed - expected).abs().max().item() < 0.02
