"""Fused mode ("naive EAGLE"): one draft token per round, and a round is one step.

The step runs the target's verify over [root, draft], commits, runs the head's catch-up over
the accepted pairs with the real target features, and reads the next round's draft off the
catch-up logits, all in one call (one CUDA graph on the GPU; the same function on the CPU).
"""

from __future__ import annotations

from spectandem.messages import DraftTree, VerifyOutput


class FusedStep:
    def __init__(self, verifier, drafter):
        if drafter.cfg.num_draft_tokens != 2:
            raise ValueError(f"fused mode needs num_draft_tokens == 2, got {drafter.cfg.num_draft_tokens}")
        self.verifier, self.drafter = verifier, drafter

    def __call__(self, tree: DraftTree) -> tuple[list[VerifyOutput], DraftTree]:
        """Verify `tree`, extend the head, and draft the next round for the same requests."""
        outs = self.verifier.verify(tree)
        self.drafter.extend(outs)
        return outs, self.drafter.draft(tree.request_ids)
