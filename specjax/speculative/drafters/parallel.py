"""The parallel drafter (PARD, arXiv 2504.18583): a small model trained with a mask token proposes all K
draft tokens of a round in one forward pass.

Each round feeds one causal pass per row over [lag, pending, MASK x (K - 1)]: the *lag* is the draft
tokens committed last round (d_1 .. d_n, fed then only as masks), the pending token the newest committed
one. The logits at pending and at each mask give K distributions q_1 .. q_K; d_i is drawn from q_i on
its own. The chain acceptance rule is exact for them: q_i is a distribution over the next token that
simply ignores d_1 .. d_{i-1}, and the rule holds for any draft distribution handed to it as the one the
token was drawn from.

The mask positions' keys/values lie beyond the history the cache holds (`commit` advances it by the lag
and pending only: the ids fed as themselves); the accepted draft tokens become the next round's lag and
are fed again as their own ids, overwriting the masks' entries before anything reads them. One pass per
round whatever K (`Proposal.calls` = 1), of the fixed width 2K (a lag of up to K ids, pending, K - 1
masks); a plain round of the adaptive K policy runs it too (it feeds the lag and pending). Chains only.

The mask token is the draft's: its id lies in the draft's vocabulary (a row the tokenizer leaves unused,
or one added for it, learned by `specjax.distill`'s `student.init = "parallel"`), saved beside the
exported weights as `parallel_draft.json` (`save_mask_token`) or given as `config.parallel.mask_token_id`.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections

from specjax import partitioning
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Params, forward_hidden, hidden_to_logits, prefill
from specjax.sampling import SamplingParams, tokens_and_probabilities
from specjax.speculative.drafters.base import DraftPass, DrafterSettings, ModelBackedDrafter
from specjax.speculative.drafters.draft_head import draft_inputs
from specjax.speculative.drafters.spelling import check_compatible
from specjax.speculative.plan import RoundPlan
from specjax.speculative.proposal import Proposal

if TYPE_CHECKING:
  from specjax.models.load import LoadedModel

MASK_FILE = "parallel_draft.json"  # {"format": _FORMAT, "mask_token_id": int}, beside an exported draft
_FORMAT = "specjax-parallel-draft"


def save_mask_token(directory: str, mask_token_id: int) -> None:
  """Records a parallel draft's mask token in its exported directory."""
  with open(os.path.join(directory, MASK_FILE), "w") as f:
    json.dump({"format": _FORMAT, "mask_token_id": int(mask_token_id)}, f, indent=2)


def load_mask_token(directory: str) -> int | None:
  """The mask token a draft directory records (`save_mask_token`), None when it records none."""
  path = os.path.join(directory, MASK_FILE)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    meta = json.load(f)
  if meta.get("format") != _FORMAT:
    raise ValueError(f"{path}: format {meta.get('format')!r}, expected {_FORMAT!r}")
  return int(meta["mask_token_id"])


@flax.struct.dataclass
class ParallelDraftState:
  cache: KVCache  # [L, B, S, G, Dh] draft cache: the history fed as real ids, all but its last `lag` tokens
  lag_ids_BxK: jax.Array  # [B, K] int32: the draft ids of the history the cache lacks (first `lag`), oldest first
  lag: jax.Array  # [B] int32 in [0, K]: the draft tokens committed last round, fed then as masks only


def draw_block(key: jax.Array, logits_BxKxW: jax.Array, sampling: SamplingParams) -> tuple[jax.Array, jax.Array | None]:
  """d_i from q_i, position by position: under a constraint q_i is masked by the state after d_1 .. d_{i-1}
  (`SamplingParams.after`), so the draft proposes only what the constraint allows along its own path;
  unconstrained, each q_i is the pass's own. Returns (tokens [B, K], their distributions [B, K, W] or
  None when greedy)."""
  tokens, probs = [], []
  for i, step_key in enumerate(jax.random.split(key, logits_BxKxW.shape[1])):
    token_B, probs_BxW = tokens_and_probabilities(step_key, logits_BxKxW[:, i], sampling)
    sampling = sampling.after(token_B[:, None], 1)
    tokens.append(token_B)
    probs.append(probs_BxW)
  return jnp.stack(tokens, axis=1), None if probs[0] is None else jnp.stack(probs, axis=1)


class ParallelDrafter(ModelBackedDrafter):
  """A mask-trained draft model proposing K tokens from one pass per round (see the module docstring)."""

  name: ClassVar[str] = "parallel"
  loads_draft_model: ClassVar[bool] = True
  config: ModelConfig = flax.struct.field(pytree_node=False)
  params: Params
  mask_id: int = flax.struct.field(pytree_node=False)  # the draft's mask token
  k: int = flax.struct.field(pytree_node=False)  # K, the block one pass proposes: the loop's K (the lag's width)
  cache_sharding: Any = flax.struct.field(pytree_node=False, default=None)  # the draft cache's placement on a mesh

  @classmethod
  def config_group(cls) -> ml_collections.ConfigDict:
    group = ml_collections.ConfigDict()
    group.mask_token_id = -1  # the draft's mask token; -1 = the one its directory records (parallel_draft.json)
    return group

  @classmethod
  def check_config(cls, settings: DrafterSettings) -> None:
    super().check_config(settings)  # no trees
    if not settings.draft:
      raise ConfigError("config.draft is empty but config.drafter is 'parallel': give a draft trained with a mask "
                        "token (specjax.distill, student.init = 'parallel')")
    if settings.options.mask_token_id < -1:
      raise ConfigError(f"{settings.field('mask_token_id')} must be a token id or -1 (the draft's own), got "
                        f"{settings.options.mask_token_id}")

  @classmethod
  def build(cls, settings: DrafterSettings, target: LoadedModel, draft: LoadedModel | None,
            log: Callable[[str], None] = print) -> tuple[ParallelDrafter, dict]:
    if draft is None:
      raise ValueError("drafter 'parallel' needs a loaded draft model")
    check_compatible(target, draft)  # the target's tokenizer (the mask row lies beyond both)
    mask_id = settings.options.mask_token_id
    if mask_id == -1:
      mask_id = load_mask_token(settings.draft) if os.path.isdir(settings.draft) else None
      if mask_id is None:
        raise ConfigError(f"{settings.field('mask_token_id')} is -1 but {settings.draft} records no mask token "
                          f"({MASK_FILE}): give the id the draft was trained with")
    if not 0 <= mask_id < draft.config.vocab_size:
      raise ConfigError(f"{settings.field('mask_token_id')}: mask token {mask_id} lies outside the draft's "
                        f"vocabulary of {draft.config.vocab_size}")
    drafter = cls(draft.config, draft.params, mask_id, settings.k,
                  cache_sharding=partitioning.cache_sharding(draft.config, draft.part))
    return drafter, {"parallel_mask_token_id": mask_id}

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  @property
  def cache_config(self) -> ModelConfig:
    return self.config

  def check(self, target_config: ModelConfig) -> None:
    if not 0 <= self.mask_id < self.config.vocab_size:
      raise ValueError(f"mask token {self.mask_id} lies outside the draft's vocabulary of {self.config.vocab_size}")

  def check_fits(self, storage: KVCache, prompt_lengths_B, max_new_tokens: int, k: int) -> None:
    if k != self.k:
      raise ValueError(f"k = {k}, but the parallel drafter was built for blocks of K = {self.k}")
    super().check_fits(storage, prompt_lengths_B, max_new_tokens, k)

  def draft_pass(self) -> DraftPass:
    return DraftPass(self.config, self.params)

  def passes(self, length: int) -> int:
    """One pass fills the whole block; a plain round runs it too (it feeds the lag and pending)."""
    return 1

  def lookahead(self, k: int) -> int:
    """The pass writes 2K positions from one short of the target's length less the lag: 2K - 2 past the
    point where the target's block starts."""
    return 2 * k - 2

  def init(self, storage: KVCache, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array,
           target_cache: KVCache) -> ParallelDraftState:
    batch = prompts_BxP.shape[0]
    cache = storage.replace(lengths=jnp.zeros((batch,), jnp.int32))  # whatever it held before
    _, cache = prefill(self.config, self.params, draft_inputs(self.config, None, prompts_BxP), prompt_lengths_B, cache)
    return ParallelDraftState(cache=cache, lag_ids_BxK=jnp.zeros((batch, self.k), jnp.int32), lag=jnp.zeros((batch,),
                                                                                                            jnp.int32))

  def block(self, state: ParallelDraftState, pending_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Row b's pass [lag, pending, MASK x (K - 1)], padded with masks to 2K ids [B, 2K], and where its K
    distributions are read: pending's and the masks' positions [B, K]."""
    batch, k = pending_B.shape[0], self.k
    lag_ids_Bx2K = jnp.pad(state.lag_ids_BxK, ((0, 0), (0, k)))
    slot_Bx2K = jnp.broadcast_to(jnp.arange(2 * k), (batch, 2 * k))
    lag_B1 = state.lag[:, None]
    ids_Bx2K = jnp.where(
        slot_Bx2K < lag_B1, lag_ids_Bx2K,
        jnp.where(slot_Bx2K == lag_B1,
                  draft_inputs(self.config, None, pending_B)[:, None], self.mask_id))
    return ids_Bx2K, lag_B1 + jnp.arange(k)[None, :]

  def propose(self, state: ParallelDraftState, target_cache: KVCache, pending_B: jax.Array, sampling: SamplingParams,
              key: jax.Array, plan: RoundPlan) -> tuple[Proposal, ParallelDraftState, KVCache]:
    """K tokens per row, d_i drawn from q_i alone, from one pass; the cache is written, not advanced."""
    k = self.k
    ids_Bx2K, read_BxK = self.block(state, pending_B)
    hidden_Bx2KxD, cache = forward_hidden(self.config, self.params, ids_Bx2K, state.cache)
    hidden_BxKxD = jnp.take_along_axis(hidden_Bx2KxD, read_BxK[:, :, None], axis=1)
    tokens_BxK, probs_BxKxW = self.draw(key, hidden_to_logits(self.config, self.params, hidden_BxKxD), sampling)
    proposal = Proposal(tokens=tokens_BxK, lengths=plan.clip(jnp.full(pending_B.shape, k, jnp.int32)),
                        probs=probs_BxKxW, calls=jnp.int32(1))
    return proposal, state.replace(cache=cache), target_cache

  def draw(self, key: jax.Array, logits_BxKxW: jax.Array,
           sampling: SamplingParams) -> tuple[jax.Array, jax.Array | None]:
    """The block's tokens and distributions from its logits (`draw_block`: a key per position), the step a
    variant of the drafter (or a test's mutant) replaces."""
    return draw_block(key, logits_BxKxW, sampling)

  def commit(self, state: ParallelDraftState, proposal: Proposal, num_committed_B: jax.Array,
             target_features_BxK1xF: jax.Array) -> ParallelDraftState:
    """[pending, d_1 .. d_n] committed: the lag and pending were fed as themselves (the cache advances
    past them); d_1 .. d_n, fed as masks, become the lag. Rows committing nothing keep their state."""
    committed_B = num_committed_B > 0
    return ParallelDraftState(
        cache=state.cache.advance(jnp.where(committed_B, state.lag + 1, 0)),
        lag_ids_BxK=jnp.where(committed_B[:, None], draft_inputs(self.config, None, proposal.tokens),
                              state.lag_ids_BxK), lag=jnp.where(committed_B, num_committed_B - 1, state.lag))
