"""Speculative decoding: the acceptance rule, drafters and the jitted generate loop."""

from specjax.speculative.acceptance import residual, verify
from specjax.speculative.drafters import Drafter, ModelDrafter, ModelDraftState
from specjax.speculative.loop import SpeculativeOutput, speculative_generate

__all__ = ["Drafter", "ModelDraftState", "ModelDrafter", "SpeculativeOutput", "residual",
           "speculative_generate", "verify"]
