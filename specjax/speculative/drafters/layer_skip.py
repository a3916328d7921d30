"""The self-speculative drafter (LayerSkip, SWIFT, Draft & Verify): the target drafts for itself with a
subset of its own layers (the final norm and output head always), so there is no second model, no second
copy of the weights, no second KV cache and no draft prefill.

The draft reads the target's cache: at committed positions the selected layers hold the keys/values the
full target computed there. Its own K passes (pending, d_1 .. d_{K-1}) write their keys/values into the
same cache at the selected layers, at positions length .. length + K - 1 of each row: uncommitted
positions, which the verify pass of [pending, d_1 .. d_K] overwrites at every layer before anything is
committed. The state is therefore empty; exactness needs nothing else (the acceptance rule holds for any
draft distribution). With every layer selected the draft equals the target and is always accepted.
"""

from __future__ import annotations

from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections

from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Params, forward_hidden, hidden_to_logits
from specjax.sampling import SamplingParams, tokens_and_probabilities
from specjax.errors import ConfigError
from specjax.speculative.drafters.base import DraftPass, DrafterSettings, ModelBackedDrafter, draft_chain
from specjax.speculative.plan import RoundPlan
from specjax.speculative.proposal import Proposal


def parse_layers(spec: str, n_layers: int) -> tuple[int, ...]:
  """"0-11" or "0,2,4-9,27" -> ascending distinct layer indices, each in [0, n_layers)."""
  layers = set()
  for part in filter(None, (p.strip() for p in spec.split(","))):
    first, dash, last = part.partition("-")
    try:
      start, end = int(first), int(last if dash else first)
    except ValueError:
      raise ValueError(f"layers {spec!r}: {part!r} is not a layer index or a range like 0-11") from None
    if start > end:
      raise ValueError(f"layers {spec!r}: range {part!r} runs backwards")
    layers.update(range(start, end + 1))
  if not layers:
    raise ValueError(f"layers {spec!r} selects no layer")
  if min(layers) < 0 or max(layers) >= n_layers:
    raise ValueError(f"layers {spec!r} must lie in 0-{n_layers - 1} (the target has {n_layers} layers)")
  return tuple(sorted(layers))


class LayerSkipDrafter(ModelBackedDrafter):
  """The target (`config`, `params`: the target's own arrays, not a copy) run through `layers` only."""

  name: ClassVar[str] = "layer_skip"
  config: ModelConfig = flax.struct.field(pytree_node=False)
  params: Params
  layers: tuple[int, ...] = flax.struct.field(pytree_node=False)

  @classmethod
  def config_group(cls) -> ml_collections.ConfigDict:
    group = ml_collections.ConfigDict()
    group.layers = ""  # the target's layers that draft, e.g. "0-11" or "0,2,4-9,27"
    return group

  @classmethod
  def check_config(cls, settings: DrafterSettings) -> None:
    super().check_config(settings)  # no trees
    try:
      parse_layers(settings.options.layers, n_layers=2**31)  # the syntax now; the range once the target is known
    except ValueError as e:
      raise ConfigError(f"config.layer_skip.{e}") from None

  @classmethod
  def build(cls, settings: DrafterSettings, target, draft, log=print) -> tuple[LayerSkipDrafter, dict]:
    try:
      layers = parse_layers(settings.options.layers, target.config.n_layers)
    except ValueError as e:
      raise ConfigError(f"config.layer_skip.{e}") from None
    return cls(target.config, target.params, layers), {"draft_layers": list(layers)}

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  def check(self, target_config: ModelConfig) -> None:
    if target_config != self.config:
      raise ValueError("a layer-skip drafter drafts with the target's own layers: its config must be the "
                       "target's")
    if not self.layers or list(self.layers) != sorted(set(
        self.layers)) or not (0 <= self.layers[0] and self.layers[-1] < self.config.n_layers):
      raise ValueError(f"draft layers {self.layers} must be ascending distinct indices in "
                       f"[0, {self.config.n_layers})")

  def draft_pass(self) -> DraftPass:
    return DraftPass(self.config, self.params, layers=self.layers)

  def propose(self, state: None, target_cache: KVCache, pending_B: jax.Array, sampling: SamplingParams, key: jax.Array,
              plan: RoundPlan) -> tuple[Proposal, None, KVCache]:
    def step(carry, step_key, sampling):
      cache, token_B = carry
      hidden_Bx1xD, cache = forward_hidden(self.config, self.params, token_B[:, None], cache, self.layers)
      # Greedy: point masses (probs None), no [K, B, V] distributions.
      next_B, probs_BxV = tokens_and_probabilities(step_key,
                                                   hidden_to_logits(self.config, self.params, hidden_Bx1xD[:, 0]),
                                                   sampling)
      return (cache.advance(jnp.ones_like(next_B)), next_B), (next_B, probs_BxV)

    # Up to K passes: pending, then d_1 .. d_{K-1}, each at the next position of the row.
    (cache, _), proposal = draft_chain(step, (target_cache, pending_B), key, plan, sampling)
    return proposal, None, cache.replace(lengths=target_cache.lengths)
