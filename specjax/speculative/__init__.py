"""Speculative decoding: the jitted loop (`loop`), the acceptance rule (`acceptance`), what a drafter
hands the verifier (`proposal`); the drafters (`drafters/`) and draft trees (`trees/`)."""

from specjax.speculative.acceptance import residual, verify, verify_greedy
from specjax.speculative.drafters.base import DraftPass, Drafter, DrafterSettings, ModelBackedDrafter
from specjax.speculative.drafters.eagle import EagleDrafter, EagleState
from specjax.speculative.drafters.history import HistoryDrafter, HistoryState
from specjax.speculative.drafters.layer_skip import LayerSkipDrafter
from specjax.speculative.drafters.model import ModelDrafter, ModelDraftState
from specjax.speculative.drafters.ngram import NgramDrafter
from specjax.speculative.loop import SpeculativeLoop, SpeculativeOutput, speculative_generate
from specjax.speculative.proposal import Proposal

__all__ = [
    "DraftPass", "Drafter", "DrafterSettings", "EagleDrafter", "EagleState", "HistoryDrafter", "HistoryState",
    "LayerSkipDrafter", "ModelBackedDrafter", "ModelDraftState", "ModelDrafter", "NgramDrafter", "Proposal",
    "SpeculativeLoop", "SpeculativeOutput", "residual", "speculative_generate", "verify", "verify_greedy"
]
