"""Drafters: whatever proposes the tokens the target verifies (`base` holds the interface and its
defaults; one module per drafter)."""

from specjax.speculative.drafters.base import DraftPass, Drafter

__all__ = ["DraftPass", "Drafter"]
