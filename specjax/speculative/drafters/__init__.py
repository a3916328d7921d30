"""Drafters: whatever proposes the tokens the target verifies. `base` holds the interface with its
defaults and the model-backed base, `history` the base of drafters that read the committed tokens
alone, `registry` resolves `config.drafter`; one module per drafter (model, ngram, layer_skip, eagle, parallel),
with its helpers beside it (`model_shapes`: what the model drafter drafts per tree shape; `eagle_head`,
`eagle_io`: the EAGLE head and its weights; `draft_head`, `spelling`: restricted heads, other tokenizers)."""

from specjax.speculative.drafters.base import DraftPass, Drafter, DrafterSettings, ModelBackedDrafter
from specjax.speculative.drafters.history import HistoryDrafter, HistoryState

__all__ = ["DraftPass", "Drafter", "DrafterSettings", "HistoryDrafter", "HistoryState", "ModelBackedDrafter"]
