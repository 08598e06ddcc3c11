"""Batch sampler on tensors: penalties, min_tokens suppression, temperature, min-p, top-k, top-p, seeds, logprobs.

Every knob is a per-row tensor, so a batch of any composition is one set of vectorized ops (no per-request loop).
Order (vLLM v1): repetition/frequency/presence penalties and min_tokens suppression on the raw logits, then
greedy rows take the argmax; sampled rows divide by temperature, drop tokens under min_p x the top probability,
keep the top_k, then the smallest prefix reaching top_p, and draw.

Seeds: a seeded row's noise is a counter-based hash of (seed, index of the token being generated, vocab id), not
a stateful generator, so the same seed gives the same tokens alone, in any batch, after a preemption, and on every
tensor-parallel rank. Unseeded rows share one torch.Generator (seeded identically on every rank).

Logprobs (and the top-n alternatives) are log-softmax of the RAW model logits, which is what vLLM returns by
default: they describe the model, not the sampling knobs.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from ringserve.workers.model.cpu_ops import greedy_tokens

GREEDY_TEMPERATURE = 1e-5  # at or below this, sampling is argmax
_U32 = 0xFFFFFFFF


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, aligned with the logits rows. Optional parts are None when no row uses them."""

    temperature: torch.Tensor  # float32 [rows]; 0 = greedy
    top_k: torch.Tensor  # int64 [rows]; 0 = off
    top_p: torch.Tensor  # float32 [rows]; 1 = off
    min_p: torch.Tensor | None = None  # float32 [rows]; 0 = off
    seeds: torch.Tensor | None = None  # int64 [rows]; used where has_seed
    has_seed: torch.Tensor | None = None  # bool [rows]
    output_index: torch.Tensor | None = None  # int64 [rows]: outputs generated so far (the seeded noise counter)
    # Penalties (None = no row has one): token history [rows, L] padded with -1, prompt length, total length.
    repetition_penalty: torch.Tensor | None = None  # float32 [rows]; 1 = off
    frequency_penalty: torch.Tensor | None = None  # float32 [rows]; 0 = off
    presence_penalty: torch.Tensor | None = None  # float32 [rows]; 0 = off
    token_ids: torch.Tensor | None = None  # int64 [rows, L]
    num_prompt_tokens: torch.Tensor | None = None  # int64 [rows]
    num_tokens: torch.Tensor | None = None  # int64 [rows]
    # min_tokens: ids masked in rows where suppress_active ([rows, S] padded with -1).
    suppress_token_ids: torch.Tensor | None = None
    suppress_active: torch.Tensor | None = None  # bool [rows]
    num_logprobs: torch.Tensor | None = None  # int64 [rows]; top-n alternatives wanted (0 = none)

    @classmethod
    def build(
        cls,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        seeds: list[int | None] | None = None,
        device: torch.device | str = "cpu",
        **optional: torch.Tensor | None,
    ) -> SamplingBatch:
        """Convenience for tests and callers holding lists; `seeds[i]` None = unseeded row."""
        rows = len(temperature)
        seed_list = seeds if seeds is not None else [None] * rows
        batch = cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            seeds=torch.tensor([s or 0 for s in seed_list], dtype=torch.int64, device=device),
            has_seed=torch.tensor([s is not None for s in seed_list], dtype=torch.bool, device=device),
        )
        for name, value in optional.items():
            setattr(batch, name, value)
        return batch


    @classmethod
    def from_columns(
        cls,
        params: Mapping[str, np.ndarray],
        to_tensor: Callable[[np.ndarray], torch.Tensor],
        output_index: torch.Tensor,
        history: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> SamplingBatch:
        """The batch of rows whose sampling fields (every SamplingParams field by name, one value per row) are
        `params`; optional parts only where a row uses them. `history()` gives (token_ids [rows, L] padded with -1,
        num_tokens, num_prompt_tokens), needed only by penalties."""
        batch = cls(
            temperature=to_tensor(params["temperature"]),
            top_k=to_tensor(params["top_k"]),
            top_p=to_tensor(params["top_p"]),
            min_p=to_tensor(params["min_p"]) if params["min_p"].any() else None,
            seeds=to_tensor(params["seed"]),
            has_seed=to_tensor(params["has_seed"]),
            output_index=output_index,
            num_logprobs=to_tensor(params["num_logprobs"]) if params["num_logprobs"].any() else None,
        )
        penalised = (
            (params["repetition_penalty"] != 1.0).any()
            or params["frequency_penalty"].any()
            or params["presence_penalty"].any()
        )
        if penalised:
            batch.repetition_penalty = to_tensor(params["repetition_penalty"])
            batch.frequency_penalty = to_tensor(params["frequency_penalty"])
            batch.presence_penalty = to_tensor(params["presence_penalty"])
            batch.token_ids, batch.num_tokens, batch.num_prompt_tokens = history()
        return batch


def greedy_is_plain(params: Mapping[str, Any]) -> bool:
    """True when a request with these sampling fields (one value each) takes the argmax of its logits unchanged:
    greedy, no penalty, no top logprobs (min_tokens suppression is the batch's to check, per step)."""
    return bool(
        params["temperature"] <= GREEDY_TEMPERATURE
        and params["repetition_penalty"] == 1.0
        and params["frequency_penalty"] == 0.0
        and params["presence_penalty"] == 0.0
        and params["num_logprobs"] == 0
    )


class SamplerOutput(NamedTuple):
    token_ids: torch.Tensor  # int64 [rows]
    logprobs: torch.Tensor  # float32 [rows]
    top_token_ids: torch.Tensor | None  # int32 [rows, n], -1 where a row asked fewer
    top_logprobs: torch.Tensor | None  # float32 [rows, n]


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        # Unseeded rows draw from this one generator; seeded rows never touch it, so their streams stay reproducible.
        self.generator = generator if generator is not None else torch.Generator()

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (token ids int64 [rows], logprobs float32 [rows])."""
        out = self.sample(logits, batch)
        return out.token_ids, out.logprobs

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        sampled_rows = batch.temperature > GREEDY_TEMPERATURE
        any_sampled = bool(sampled_rows.any())
        wants_top = batch.num_logprobs is not None and bool((batch.num_logprobs > 0).any())
        plain = batch.token_ids is None and (batch.suppress_active is None or not bool(batch.suppress_active.any()))
        if plain and not any_sampled and not wants_top:
            return self.greedy(logits)
        raw = logits.float()
        logits = apply_suppression(apply_penalties(raw, batch), batch)
        tokens = logits.argmax(dim=-1)
        if any_sampled:
            rows = sampled_rows.nonzero().squeeze(1)
            tokens[rows] = self._sample(logits[rows], _select(batch, rows))
        if wants_top:
            raw_logprobs = torch.log_softmax(raw, dim=-1)
            logprobs = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
            top_ids, top_lps = top_logprobs(raw_logprobs, batch.num_logprobs)
            return SamplerOutput(tokens, logprobs, top_ids, top_lps)
        # Only the sampled tokens' log-probabilities: no [rows, vocab] log-softmax.
        logprobs = raw.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(raw, dim=-1)
        return SamplerOutput(tokens, logprobs, None, None)

    @torch.inference_mode()
    def greedy(self, logits: torch.Tensor) -> SamplerOutput:
        """What sample() gives rows that are greedy with nothing to adjust (no penalty, no active min_tokens
        suppression, no top logprobs), without a SamplingBatch: the argmax and its log-probability, in one native
        pass on CPU."""
        native = greedy_tokens(logits)
        if native is not None:
            return SamplerOutput(native[0], native[1], None, None)
        raw = logits.float()
        tokens = raw.argmax(dim=-1)
        logprobs = raw.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(raw, dim=-1)
        return SamplerOutput(tokens, logprobs, None, None)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        probs = sampling_distribution(logits, batch)
        return (probs / self._exponential_noise(probs, batch)).argmax(dim=-1)

    def _exponential_noise(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Exponential race (argmax p / E, E ~ Exp(1)) samples p exactly; each row's E from its own stream: a seeded
        row's from its seed and output index, another's from the sampler's generator."""
        rows, vocab = probs.shape
        seeded = batch.has_seed if batch.has_seed is not None and bool(batch.has_seed.any()) else None
        index = batch.output_index if batch.output_index is not None else torch.zeros(rows, dtype=torch.int64,
                                                                                     device=probs.device)  # fmt: skip
        if probs.device.type != "cpu":  # a GPU draws the generator's noise fast: for every row, seeded ones replaced
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            if seeded is not None:
                r = seeded.nonzero().squeeze(1)
                noise[r] = seeded_exponential(batch.seeds[r], index[r], vocab)  # type: ignore[index]
            return noise.clamp_(min=1e-20)
        # On CPU every row gets the hashed noise, an unseeded one keyed by a fresh 64-bit draw from the generator:
        # torch's exponential_ took 65 ms for 48 rows of a 49,152-id vocabulary, the hash ~20 ms.
        keys = torch.randint(-(2**63), 2**63 - 1, (rows,), dtype=torch.int64, generator=self.generator)
        counters = torch.zeros(rows, dtype=torch.int64)
        if seeded is not None:
            keys[seeded] = batch.seeds[seeded]  # type: ignore[index]
            counters[seeded] = index[seeded]
        # Never 0 (the hash's uniform draws stay below 1), so no zero-probability token becomes 0/0 = NaN.
        return seeded_exponential(keys, counters, vocab).to(probs.dtype)


def sampling_distribution(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each sampled row draws from: softmax(logits / T), then min-p, top-k, top-p (renormalised)."""
    vocab = logits.shape[-1]
    probs = (logits / batch.temperature.unsqueeze(1)).softmax(dim=-1)
    if batch.min_p is not None and bool((batch.min_p > 0).any()):
        floor = batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    if bool(((batch.top_k > 0) & (batch.top_k < vocab)).any()) or bool((batch.top_p < 1.0).any()):
        # Work in descending order: top-k is a prefix, top-p a prefix of the cumulative mass.
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
        k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=vocab), vocab).unsqueeze(1)
        sorted_probs = sorted_probs.masked_fill(rank >= k, 0.0)
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        # Drop a token when the mass strictly before it already reaches top_p; the top token always survives.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= batch.top_p.unsqueeze(1), 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def _select(batch: SamplingBatch, rows: torch.Tensor) -> SamplingBatch:
    picked = {name: (value[rows] if isinstance(value, torch.Tensor) else value) for name, value in vars(batch).items()}
    return SamplingBatch(**picked)


def _hash32(x: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
    """lowbias32 integer hash, in place on a uint32 array (products wrap mod 2**32, as the hash means them)."""
    tmp = np.empty_like(x) if scratch is None else scratch
    np.right_shift(x, 16, out=tmp)
    x ^= tmp
    x *= np.uint32(0x7FEB352D)
    np.right_shift(x, 15, out=tmp)
    x ^= tmp
    x *= np.uint32(0x846CA68B)
    np.right_shift(x, 16, out=tmp)
    x ^= tmp
    return x


@functools.lru_cache(maxsize=4)
def _spread_vocab(vocab: int) -> np.ndarray:
    return np.arange(vocab, dtype=np.uint32) * np.uint32(0x9E3779B1)  # wraps mod 2**32


# Rows x vocab from which seeded noise is computed in several threads (numpy releases the GIL in its loops).
_PARALLEL_NOISE_VALUES = 1 << 20
_noise_pool: ThreadPoolExecutor | None = None


def _noise_rows(key: np.ndarray, key2: np.ndarray, vocab: int, out: np.ndarray) -> None:
    x = _spread_vocab(vocab)[None, :] + key[:, None]
    scratch = np.empty_like(x)
    _hash32(x, scratch)
    x ^= key2[:, None]
    _hash32(x, scratch)
    uniform = x.astype(np.float64)
    uniform += 0.5
    uniform /= 4294967296.0  # (0, 1), never 0
    np.log(uniform, out=uniform)
    np.negative(uniform, out=out, casting="same_kind")


def _hash32_tensor(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding 32-bit values (products wrap; the low 32 bits stay exact)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _U32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _U32
    return x ^ (x >> 16)


def _seeded_exponential_tensor(seeds: torch.Tensor, output_index: torch.Tensor, vocab: int) -> torch.Tensor:
    """seeded_exponential as torch ops on the seeds' device (a GPU's)."""
    lo, hi = seeds & _U32, (seeds >> 32) & _U32
    key = _hash32_tensor(_hash32_tensor(lo ^ _hash32_tensor(hi)) ^ (output_index & _U32))  # [rows]
    vocab_ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64).unsqueeze(0)
    first = _hash32_tensor((vocab_ids * 0x9E3779B1 + key.unsqueeze(1)) & _U32)
    bits = _hash32_tensor(first ^ _hash32_tensor(key ^ 0x85EBCA6B).unsqueeze(1))
    uniform = (bits.double() + 0.5) / 4294967296.0  # (0, 1), never 0
    return (-torch.log(uniform)).float()


def seeded_exponential(seeds: torch.Tensor, output_index: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] float32, a pure function of (seed, output index, vocab id): uint32 arithmetic and a
    float64 log in numpy, which does it in a few passes over 4-byte values (as int64 torch tensors it took ~10 passes
    over 8-byte ones: 112 ms for 48 rows of SmolLM2's 49,152 ids, now ~20 ms with two threads). Off the CPU, the same
    function as torch ops on the seeds' device."""
    global _noise_pool
    if seeds.device.type != "cpu":
        return _seeded_exponential_tensor(seeds, output_index, vocab)
    s = seeds.detach().cpu().numpy().astype(np.int64)
    index = output_index.detach().cpu().numpy().astype(np.int64)
    lo, hi = (s & _U32).astype(np.uint32), ((s >> 32) & _U32).astype(np.uint32)
    key = _hash32(_hash32(lo ^ _hash32(hi)) ^ (index & _U32).astype(np.uint32))  # [rows]
    # Two rounds keyed differently, so rows with related keys do not get permutations of the same noise.
    key2 = _hash32(key ^ np.uint32(0x85EBCA6B))
    rows = len(key)
    out = np.empty((rows, vocab), dtype=np.float32)
    threads = min(rows, max(1, torch.get_num_threads()))
    if threads > 1 and rows * vocab >= _PARALLEL_NOISE_VALUES:
        if _noise_pool is None:
            _noise_pool = ThreadPoolExecutor(max_workers=max(2, torch.get_num_threads()), thread_name_prefix="noise")
        bounds = np.linspace(0, rows, threads + 1).astype(int)
        parts = [_noise_pool.submit(_noise_rows, key[a:b], key2[a:b], vocab, out[a:b])
                 for a, b in itertools.pairwise(bounds) if b > a]  # fmt: skip
        for part in parts:
            part.result()
    else:
        _noise_rows(key, key2, vocab, out)
    return torch.from_numpy(out)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM semantics: repetition over prompt + output tokens, frequency and presence over output tokens."""
    if batch.token_ids is None or batch.num_tokens is None or batch.num_prompt_tokens is None:
        return logits
    rows, vocab = logits.shape
    history = batch.token_ids
    position = torch.arange(history.shape[1], device=logits.device).unsqueeze(0)
    valid = (position < batch.num_tokens.unsqueeze(1)) & (history >= 0)
    is_output = valid & (position >= batch.num_prompt_tokens.unsqueeze(1))
    index = torch.where(valid, history, vocab)  # padding lands in a spare column that is dropped
    seen = torch.zeros(rows, vocab + 1, device=logits.device).scatter_(1, index, 1.0)[:, :vocab] > 0
    output_index = torch.where(is_output, history, vocab)
    counts = torch.zeros(rows, vocab + 1, device=logits.device)
    counts = counts.scatter_add_(1, output_index, torch.ones_like(output_index, dtype=counts.dtype))[:, :vocab]
    if batch.repetition_penalty is not None:
        penalty = batch.repetition_penalty.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if batch.frequency_penalty is not None:
        logits = logits - batch.frequency_penalty.unsqueeze(1) * counts
    if batch.presence_penalty is not None:
        logits = logits - batch.presence_penalty.unsqueeze(1) * (counts > 0).float()
    return logits


def apply_suppression(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """min_tokens: the stop/EOS ids cannot be sampled while a row has fewer outputs than it asked for."""
    ids, active = batch.suppress_token_ids, batch.suppress_active
    if ids is None or active is None or not bool(active.any()):
        return logits
    vocab = logits.shape[1]
    index = torch.where((ids >= 0) & (ids < vocab) & active.unsqueeze(1), ids, vocab).long()
    padded = torch.cat([logits, logits.new_zeros(logits.shape[0], 1)], dim=1)
    return padded.scatter_(1, index, float("-inf"))[:, :vocab]


def top_logprobs(
    raw_logprobs: torch.Tensor, num_logprobs: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Top-n alternatives per row, n = the largest ask; rows asking fewer are padded with id -1 (logprob 0)."""
    if num_logprobs is None:
        return None, None
    n = int(num_logprobs.max()) if num_logprobs.numel() else 0
    if n <= 0:
        return None, None
    values, ids = raw_logprobs.topk(n, dim=-1)
    unused = torch.arange(n, device=ids.device).unsqueeze(0) >= num_logprobs.unsqueeze(1)
    return ids.masked_fill(unused, -1).to(torch.int32), values.masked_fill(unused, 0.0)
