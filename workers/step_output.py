"""What a worker step returns: the sampled tokens of the plan's sampling slots, in schedule order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class StepOutput:
    """The tokens of each slot that had sched_sample set, in schedule order: one each, or token_counts[i] each
    (accepted drafts, then the target's token) when the plan had lookahead."""

    step_id: int
    slots: np.ndarray  # int32
    token_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32
    top_token_ids: np.ndarray | None = None  # int32 [rows, n], -1 padded; None when no row asked
    top_logprobs: np.ndarray | None = None  # float32 [rows, n]
    token_counts: np.ndarray | None = None  # int32 [slots]; None = one token each
    num_proposed: np.ndarray | None = None  # int32 [slots]: draft tokens verified

    @classmethod
    def empty(cls, step_id: int) -> StepOutput:
        return cls(step_id, np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32))
