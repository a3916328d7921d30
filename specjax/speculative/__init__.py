"""Speculative decoding: the acceptance rule, the Drafter interface and its drafters, the jitted loop."""

from specjax.speculative.acceptance import residual, verify, verify_greedy
from specjax.speculative.drafters.base import Drafter
from specjax.speculative.drafters.eagle import EagleDrafter, EagleState
from specjax.speculative.loop import SpeculativeOutput, speculative_generate
from specjax.speculative.drafters.layer_skip import LayerSkipDrafter
from specjax.speculative.drafters.model import ModelDrafter, ModelDraftState
from specjax.speculative.drafters.ngram import NgramDrafter, NgramState
from specjax.speculative.proposal import Proposal

__all__ = ["Drafter", "EagleDrafter", "EagleState", "LayerSkipDrafter", "ModelDraftState", "ModelDrafter", "NgramDrafter", "NgramState",
           "Proposal", "SpeculativeOutput", "residual", "speculative_generate", "verify", "verify_greedy"]
