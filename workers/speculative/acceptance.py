"""Lossless acceptance of draft tokens against the target's logits, vectorized over the batch.

Greedy rows accept while the target's argmax equals the draft, then take the target's argmax: exactly plain greedy.
Sampled rows use the rejection-sampling rule (Leviathan et al.; Chen et al.): draft d_j is accepted with probability
min(1, p_j(d_j) / q_j(d_j)); at the first rejection the token is drawn from normalize(max(0, p_j - q_j)); when every
draft is accepted a bonus token is drawn from p_{k}. p is the target's sampling distribution after the request's
temperature, min-p, top-k and top-p (the sampler's own `sampling_distribution`); q the drafter's after the same.
So the output distribution is the target's for every setting.

When q is a point mass on d (n-gram lookup, greedy drafting) the rule is the same as drawing t ~ p_j and accepting iff
t == d: P(accept) = p(d), and a rejected draw is distributed as p without d, renormalized = normalize(max(0, p - q)).
That path draws with the sampler's own noise (seeded rows: a hash of seed and output index), so a seeded request
gives exactly the tokens it gives without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from ringserve.workers.sampler import (
    GREEDY_TEMPERATURE,
    Sampler,
    SamplingBatch,
    _select,
    sampling_distribution,
    seeded_exponential,
)

# Seeded acceptance coins come from the seeded noise of another stream than the token draws.
_COIN_STREAM = 1 << 30


@dataclass
class VerifiedTokens:
    token_ids: list[np.ndarray]  # per row: accepted drafts, then the target's token (1 .. num_drafts + 1)
    logprobs: list[np.ndarray]  # raw-logit logprobs of those tokens (what the plain sampler reports)


def verify_drafts(
    logits: torch.Tensor,
    num_drafts: np.ndarray,
    drafts: list[np.ndarray],
    batch: SamplingBatch,
    sampler: Sampler,
    draft_probs: list[torch.Tensor | None] | None = None,
) -> VerifiedTokens:
    """logits: the target's rows, 1 + num_drafts[i] per row i in order (row i's position j scores draft j).

    `batch` has one row per request with output_index = outputs generated so far. draft_probs[i] ([num_drafts[i],
    vocab], the drafter's sampling distribution) or None = point-mass drafts.
    """
    rows = len(num_drafts)
    k = int(num_drafts.max()) if rows else 0
    vocab = logits.shape[-1]
    device = logits.device
    counts = torch.from_numpy(num_drafts.astype(np.int64)).to(device)
    starts = torch.cumsum(counts + 1, 0) - (counts + 1)
    pos = torch.arange(k + 1, device=device)
    # [rows, k + 1] packed row index of each position; padding repeats the row's last position.
    index = starts.unsqueeze(1) + torch.minimum(pos.unsqueeze(0), counts.unsqueeze(1))
    target = logits.float()[index]  # [rows, k + 1, vocab]
    raw_logprobs = torch.log_softmax(target, dim=-1)
    draft_ids = torch.zeros(rows, max(k, 1), dtype=torch.int64, device=device)
    for i, d in enumerate(drafts):
        if len(d):
            draft_ids[i, : len(d)] = torch.from_numpy(np.asarray(d, np.int64)).to(device)
    valid = pos[:k].unsqueeze(0) < counts.unsqueeze(1)  # [rows, k]

    # Per-position parameters: row i's params repeated k + 1 times, the seeded noise counter advancing per position.
    flat = torch.arange(rows, device=device).repeat_interleave(k + 1)
    expanded = _select(batch, flat)
    base = batch.output_index if batch.output_index is not None else torch.zeros(rows, dtype=torch.int64)
    expanded.output_index = (base.unsqueeze(1) + pos.unsqueeze(0)).reshape(-1)

    chosen = target.argmax(dim=-1)  # [rows, k + 1]: greedy rows' tokens
    accepted = _leading(chosen[:, :k] == draft_ids[:, :k], valid)
    sampled = batch.temperature > GREEDY_TEMPERATURE
    point_mass = draft_probs is None or all(q is None for q in draft_probs)
    if bool(sampled.any()):
        srows = sampled.nonzero().squeeze(1)
        sflat = (srows.unsqueeze(1) * (k + 1) + pos.unsqueeze(0)).reshape(-1)
        sbatch = _select(expanded, sflat)
        probs = sampling_distribution(target[srows].reshape(-1, vocab), sbatch)  # p, [srows * (k + 1), vocab]
        if point_mass:
            draws = (probs / sampler._exponential_noise(probs, sbatch)).argmax(dim=-1).view(len(srows), k + 1)
            chosen[srows] = draws
            accepted[srows] = _leading(draws[:, :k] == draft_ids[srows, :k], valid[srows])
        else:
            assert draft_probs is not None
            p = probs.view(len(srows), k + 1, vocab)
            q = torch.zeros(len(srows), max(k, 1), vocab, device=device)
            for out_row, i in enumerate(srows.tolist()):
                qi = draft_probs[i]
                n = int(num_drafts[i])
                if qi is None:  # point mass on the draft
                    q[out_row, torch.arange(n), draft_ids[i, :n]] = 1.0
                elif n:
                    q[out_row, :n] = qi[:n].float()
            d = draft_ids[srows, :k]
            p_d = p[:, :k].gather(2, d.unsqueeze(2)).squeeze(2)
            q_d = q[:, :k].gather(2, d.unsqueeze(2)).squeeze(2).clamp(min=1e-20)
            coins = _uniform(sampler, sbatch, len(srows), k + 1)[:, :k]
            ok = _leading(coins * q_d < p_d, valid[srows])  # u < p/q, i.e. accept with probability min(1, p/q)
            a = ok.to(torch.int64)
            # The distribution of the token after the accepted prefix: residual at a rejection, p at the bonus.
            p_a = p[torch.arange(len(srows)), a]
            q_a = q[torch.arange(len(srows)), a.clamp(max=max(k, 1) - 1)]
            rejected = a < counts[srows]
            residual = torch.clamp(p_a - q_a, min=0.0)
            norm = residual.sum(dim=-1, keepdim=True)
            # A residual of zero mass happens only where p == q exactly there; then p itself is the answer.
            residual = torch.where(norm > 0, residual / norm.clamp(min=1e-30), p_a)
            final = torch.where(rejected.unsqueeze(1), residual, p_a)
            final_batch = _select(sbatch, torch.arange(len(srows), device=device) * (k + 1) + a)
            token = (final / sampler._exponential_noise(final, final_batch)).argmax(dim=-1)
            draws = chosen[srows]
            draws[torch.arange(len(srows)), a] = token
            chosen[srows] = draws
            accepted[srows] = ok

    chosen_np = chosen.cpu().numpy()
    accepted_np = accepted.cpu().numpy()
    lp = raw_logprobs.gather(2, chosen.unsqueeze(2)).squeeze(2).cpu().numpy()
    draft_np = draft_ids.cpu().numpy()
    lp_draft = raw_logprobs[:, : max(k, 1)].gather(2, draft_ids.unsqueeze(2)).squeeze(2).cpu().numpy()
    tokens_out, logprobs_out = [], []
    for i in range(rows):
        a = int(accepted_np[i])
        tokens_out.append(np.concatenate([draft_np[i, :a], chosen_np[i, a : a + 1]]).astype(np.int32))
        logprobs_out.append(np.concatenate([lp_draft[i, :a], lp[i, a : a + 1]]).astype(np.float32))
    return VerifiedTokens(tokens_out, logprobs_out)


def _leading(matches: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading positions match (and are real drafts)."""
    ok = (matches & valid).to(torch.int64)
    return ok.cumprod(dim=1).sum(dim=1) if ok.shape[1] else torch.zeros(ok.shape[0], dtype=torch.int64)


def _uniform(sampler: Sampler, batch: SamplingBatch, rows: int, width: int) -> torch.Tensor:
    """U(0, 1) per (row, position): seeded rows from a hash of (seed, output index), the rest from the generator."""
    u = torch.rand(rows * width, generator=sampler.generator, device=batch.temperature.device)
    if batch.has_seed is not None and bool(batch.has_seed.any()):
        r = batch.has_seed.nonzero().squeeze(1)
        index = (batch.output_index[r] if batch.output_index is not None else torch.zeros_like(r)) + _COIN_STREAM
        u[r] = torch.exp(-seeded_exponential(batch.seeds[r], index, 1).squeeze(1))  # type: ignore[index]
    return u.view(rows, width)
