"""Speculative decoding inside the worker: proposers make draft tokens, the target verifies them in one forward pass.

The engine only reserves lookahead slots (StepPlan.sched_lookahead) and receives the accepted tokens; drafts never
leave the worker (docs/contracts.md, layout version 3).
"""

from ringserve.workers.speculative.acceptance import VerifiedTokens, verify_drafts
from ringserve.workers.speculative.proposers import (
    DraftModelProposer,
    DraftProposal,
    LayerDraftProposer,
    NgramProposer,
    Proposer,
    make_proposer,
)
from ringserve.workers.speculative.tree import DraftTree

__all__ = [
    "DraftModelProposer",
    "DraftProposal",
    "DraftTree",
    "LayerDraftProposer",
    "NgramProposer",
    "Proposer",
    "VerifiedTokens",
    "make_proposer",
    "verify_drafts",
]
