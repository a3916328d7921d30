"""The Drafter interface with its defaults: whatever proposes the tokens that the target verifies in one
pass. A drafter defines only what it needs; everything optional has a default here, so the loop never
looks a member up by `getattr`.

A drafter is a `flax.struct.PyTreeNode`: every subclass is a frozen dataclass and a pytree whose arrays
(weights) are pytree fields and whose static settings are `flax.struct.field(pytree_node=False)`, so it
is an ordinary argument of the jitted loop (its arrays traced, its static fields part of the program).

Host side, before anything compiles:
  check(target_config)                  the drafter fits this target (vocabulary, layers, ...)
  storage(batch, max_len)               its preallocated, donated storage (a KV cache, a token buffer)
  check_fits(storage, lengths, budget, k)   the storage holds the longest prompt + budget + look-ahead
  storage_of(state)                     the storage inside a returned final state, for the next call
  remember(prompts, lengths, tokens, counts) -> drafter   after a call: a pool drafter keeps its sequences
  verify_widths(k)                      the verify-pass widths the loop chooses among
Inside the jitted loop:
  init(storage, prompts, lengths, target_cache) -> state
      (or init_from_features(storage, prompts, lengths, features) when `reads_prompt_features`)
  propose(state, target_cache, pending, sampling, key, plan) -> (Proposal, state, target_cache)
  commit(state, proposal, num_committed, target_features) -> state
From a decode config (class methods, `specjax.speculative.drafters.registry`):
  name, config_group(), check_config(options, settings), build(settings, target, draft, log)

Bookkeeping shared with the loop: the *pending* token is the newest committed token, not yet fed to the
target (its cache holds everything before it). A round feeds [pending, d_1 .. d_W-1] to the target; if
row b accepts n draft tokens, the n + 1 tokens [pending, d_1 .. d_n] become history (`commit` receives
num_committed = n + 1; 0 for a row that is done) and the target's next token becomes the new pending one.
The round's `plan` (`speculative.plan`) is all a drafter learns of the K policy: K, and how many tokens
(a static tree: which cut, or its spine) each row may propose this round. A proposal may be a static
tree (`Proposal.tree`): the loop verifies its nodes in one pass and hands `commit` the accepted path as a
chain (`Proposal.along`, with `path` set); what a drafter drafts is its `shape` (`trees.shapes`).
`propose` may read and write the target's cache beyond each row's length (self-speculation shares it):
whatever it writes there is overwritten by the verify pass before any of it is committed.

Two small bases cover the drafters researchers write most: `history.HistoryDrafter` (one pure function
of the committed tokens) and `ModelBackedDrafter` below (a network with its own KV cache, drafting and
committing through its shape's hooks: `propose_chain`, `commit_chain` and, for trees, `propose_static`,
`propose_dynamic`, `commit_static`, `commit_dynamic`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, ClassVar, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from specjax import generation
from specjax.errors import ConfigError
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, init_cache
from specjax.sampling import SamplingParams
from specjax.speculative.plan import RoundPlan
from specjax.speculative.proposal import Proposal
from specjax.speculative.trees import shapes
from specjax.speculative.trees.drafting import children_error
from specjax.speculative.trees.dynamic import DynamicSpec
from specjax.speculative.trees.tree import Tree

if TYPE_CHECKING:
  from specjax.models.load import LoadedModel


class DraftPass(NamedTuple):
  """One draft forward pass: a model, optionally through a restricted head or a subset of its layers."""

  config: ModelConfig
  params: Any
  head: Any = None  # a `draft_head.DraftHead`, or None for the full output head
  layers: tuple[int, ...] | None = None  # the blocks run, None for all


@dataclasses.dataclass(frozen=True)
class DrafterSettings:
  """What a drafter is checked and built from: its own config group and the decode settings any
  drafter may read, parsed once (`specjax.decode_spec`)."""

  group: str  # the group's name in the decode config ("ngram" for config.ngram)
  options: ml_collections.FrozenConfigDict  # the drafter's config group (empty when it has none)
  draft: str = ""  # config.draft: a draft model or a head directory, for drafters that load one
  tree: Tree | DynamicSpec | None = None  # config.tree, parsed; None = a chain
  tree_children: str = "iid"  # config.tree_children
  k: int = 5  # config.k: the most draft tokens a round proposes (a tree's depth when `tree` is set)
  plain_rounds: bool = False  # some rounds may propose nothing (the adaptive K policy's plain steps)

  def field(self, name: str) -> str:
    """The dotted name of one of the drafter's options, for error messages: "config.ngram.min"."""
    return f"config.{self.group}.{name}"


def short_proposal_widths(k: int) -> tuple[int, ...]:
  """Verify widths for drafters whose proposals are often short (n-gram lookups, early-stopped drafts):
  1 (no proposal), 2, 3 and 4 (one to three tokens), then the full K + 1. Each width is one more
  compiled target pass; on a CPU a 4-token pass costs about 2 single steps where a 9-token one costs
  about 2.7, so short proposals should not pay for the full block."""
  return tuple(sorted(set(range(1, min(k + 1, 5))) | {k + 1}))


# Every Drafter subclass with a `name`, by name, as its module defines it (`registry` resolves them).
REGISTERED: dict[str, type] = {}

DraftStep = Callable[[Any, jax.Array, SamplingParams], tuple[Any, tuple[jax.Array, jax.Array | None]]]


def draft_chain(step: DraftStep, carry: Any, key: jax.Array, plan: RoundPlan,
                sampling: SamplingParams) -> tuple[Any, Proposal]:
  """Draws a chain of draft tokens with `step(carry, key, sampling) -> (carry, (token_B, probs_BxW or
  None))`, one draft pass each, while fewer than the plan's depth are drawn: no pass that no row wants
  runs. Each step gets `sampling` with its constraint advanced past the tokens drawn before (the draft
  masked like the target along its own draws). Returns the final carry and the proposal (slots past the
  passes run hold zeros)."""
  k = plan.k
  keys_K = jax.random.split(key, k)
  token_shape, probs_shape = jax.eval_shape(step, carry, keys_K[0], sampling)[1]
  batch = token_shape.shape[0]
  tokens_BxK = jnp.zeros((batch, k), token_shape.dtype)
  probs_BxKxW = None if probs_shape is None else jnp.zeros((batch, k) + probs_shape.shape[1:], probs_shape.dtype)

  def one_pass(loop):
    drawn, carry, tokens_BxK, probs_BxKxW = loop
    carry, (token_B, probs_BxW) = step(carry, keys_K[drawn], sampling.after(tokens_BxK, drawn))
    return (drawn + 1, carry, tokens_BxK.at[:, drawn].set(token_B),
            None if probs_BxW is None else probs_BxKxW.at[:, drawn].set(probs_BxW))

  drawn, carry, tokens_BxK, probs_BxKxW = jax.lax.while_loop(lambda loop: loop[0] < plan.depth, one_pass,
                                                             (jnp.int32(0), carry, tokens_BxK, probs_BxKxW))
  lengths_B = plan.clip(jnp.full((batch,), drawn, jnp.int32))
  return carry, Proposal(tokens=tokens_BxK.astype(jnp.int32), lengths=lengths_B, probs=probs_BxKxW, calls=drawn)


class Drafter(flax.struct.PyTreeNode):
  """The interface the speculative loop drives, with a default for everything but `propose` (`init`,
  `propose`, `commit` are traced inside one `jax.jit`; the rest runs on the host). A drafter also says
  `vocab_size`, W: the ids its proposals' distributions span (the target's V for drafters proposing its
  ids; a model drafter's own head may be padded larger or smaller).

  A subclass with a class attribute `name` is registered under it (`config.drafter = name`); any
  subclass is reachable as `config.drafter = "package.module:ClassName"`."""

  name: ClassVar[str] = ""  # the registered name; "" = reachable by import path only
  loads_draft_model: ClassVar[bool] = False  # config.draft is a model the pipeline loads (same tokenizer)
  reads_prompt_features: ClassVar[bool] = False  # the loop calls `init_from_features` instead of `init`
  # Its proposal costs no pass and reads no plan (a lookup): the loop proposes before the K policy
  # chooses, and the policy prices what each row offers (`KPolicy.choose`'s `offered_B`).
  free_proposal: ClassVar[bool] = False
  # Defaults a subclass may redeclare as static fields (hence no annotation here: an annotated default
  # would become a dataclass field ahead of the subclass's own fields).
  tree = None  # Tree | DynamicSpec | None: a drafter drafting trees has a static field `tree` (`shape`)
  feature_layers = ()  # target blocks whose residual streams `commit` gets; () = the final-norm hidden states

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if cls.__dict__.get("name"):
      previous = REGISTERED.get(cls.name)
      if previous is not None and previous.__qualname__ != cls.__qualname__:
        raise ValueError(f"drafter name {cls.name!r} is taken by {previous.__module__}.{previous.__qualname__}")
      REGISTERED[cls.name] = cls

  # -- from a decode config (host) --------------------------------------------------------------------
  @classmethod
  def config_group(cls) -> ml_collections.ConfigDict:
    """The drafter's own settings, `config.<name>.*`, with their defaults (a comment per field)."""
    return ml_collections.ConfigDict()

  @classmethod
  def check_config(cls, settings: DrafterSettings) -> None:
    """Raises `ConfigError` naming the field for settings that cannot work, before any model loads.
    The default refuses trees: a drafter that drafts them says so by overriding this."""
    if settings.tree is not None:
      raise ConfigError(f"config.tree is set but config.drafter {cls.registered_as()!r} drafts no trees")

  @classmethod
  def build(cls, settings: DrafterSettings, target: LoadedModel, draft: LoadedModel | None,
            log: Callable[[str], None] = print) -> tuple[Drafter, dict]:
    """The drafter for `target` (and `draft`, loaded when `loads_draft_model`), and facts to record with
    the results. The default constructs the class with no arguments."""
    return cls(), {}

  @classmethod
  def config_key(cls) -> str:
    """The drafter's group in the decode config (`config.<key>.*`): its name, else its class name."""
    return cls.name or cls.__name__

  @classmethod
  def registered_as(cls) -> str:
    """Its `config.drafter` value: the registered name, else its import path."""
    return cls.name or f"{cls.__module__}:{cls.__qualname__}"

  @property
  def shape(self) -> shapes.Chain:
    """What its rounds draft: a chain, its static tree or its dynamic tree (`trees.shapes`)."""
    return shapes.of(self.tree)

  # -- host, before compiling --------------------------------------------------------------------------
  def verify_widths(self, k: int) -> tuple[int, ...]:
    """The verify-pass widths (static, ascending, the last one K + 1) the loop may run: a round whose
    longest live proposal holds n tokens runs the narrowest width >= n + 1."""
    return (k + 1,)

  def check(self, target_config: ModelConfig) -> None:
    """Raises ValueError unless the drafter can draft for this target."""

  def draft_pass(self) -> DraftPass | None:
    """What one draft forward pass runs, for its cost model (`specjax.costs`); None for a lookup."""
    return None

  def passes(self, length: int) -> int:
    """The draft passes (`draft_pass`) a round proposing `length` tokens runs, for its cost model (the
    adaptive policy's `k_policy.Prices`): one per token (a chain; a tree: one per level), none for a
    lookup, and none in a plain round (length 0: the draft catches up at the next drafting round)."""
    return length if self.draft_pass() is not None else 0

  def storage(self, batch_size: int, max_len: int) -> Any:
    """Preallocated storage for `batch_size` rows of up to `max_len` positions (donated to the loop)."""
    return None

  def check_fits(self, storage: Any, prompt_lengths_B: np.ndarray, max_new_tokens: int, k: int) -> None:
    """Raises ValueError unless `storage` holds the longest prompt, the budget and the look-ahead."""

  def storage_of(self, state: Any) -> Any:
    """The storage held by a state the loop returned: passed to the next call of the same shapes
    instead of allocating new storage (it is donated again)."""
    return None

  def remember(self, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array, tokens_BxO: jax.Array,
               counts_B: jax.Array) -> Drafter:
    """The drafter after a finished call decoded these prompts into these outputs (row b: its first
    `prompt_lengths_B[b]` and `counts_B[b]` tokens; 0 and 0 for rows to skip): a pool drafter returns
    itself with them in its pool (`suffix`), every other drafter itself. Host side, between calls; the
    result has the same shapes, so the next call reuses the compiled program."""
    return self

  def forget(self) -> Drafter:
    """The drafter with everything `remember` added dropped (`Decoder.reset_pool`)."""
    return self

  # -- inside the jitted loop --------------------------------------------------------------------------
  def init(self, storage: Any, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array, target_cache: KVCache) -> Any:
    """The state after the right-padded prompts (the target's cache already holds them)."""
    return None

  def init_from_features(self, storage: Any, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array,
                         features_BxPxF: jax.Array) -> Any:
    """`init` for a drafter that reads the target's features of the prompts (`reads_prompt_features`):
    the loop prefills the target with `prefill_features` (its `feature_layers`) and hands them over,
    so no second target prefill runs."""
    raise NotImplementedError(f"{type(self).__name__} sets reads_prompt_features but defines no "
                              f"init_from_features")

  def propose(self, state: Any, target_cache: KVCache, pending_B: jax.Array, sampling: SamplingParams, key: jax.Array,
              plan: RoundPlan) -> tuple[Proposal, Any, KVCache]:
    """Up to K = `plan.k` tokens per row following the history and `pending_B` (their distributions
    after `sampling`, or point masses), the state, and the target's cache (changed only beyond each
    row's length). Commits nothing. The round's `plan` says how many tokens row b may propose this
    round (`plan.clip`, at most `plan.depth`; a static tree: its cut at that depth, `Tree.cut`, or only
    that cut's spine where `plan.spine` holds): the loop never verifies more, so a drafter may ignore
    it, at the price of draft passes nobody reads (`draft_chain` and `grow_tree` stop them)."""
    raise NotImplementedError(f"{type(self).__name__} must define propose")

  def commit(self, state: Any, proposal: Proposal, num_committed_B: jax.Array,
             target_features_BxK1xF: jax.Array) -> Any:
    """Appends the first `num_committed_B[b]` tokens of [pending, d_1 .. d_K] to row b's history (0
    leaves the row unchanged: done rows stop there). `target_features_BxK1xF` holds the target's
    features of the verified block (positions past the pass's width are zeros): its final-norm hidden
    states, or the residual streams after the blocks the drafter names in `feature_layers`."""
    return state


class ModelBackedDrafter(Drafter):
  """A drafter that runs a network with a KV cache of its own (`cache_config`; None = it shares the
  target's, as self-speculation does): the storage is that cache, the state holds it as `state.cache`,
  and it must hold each row's history plus the draft's look-ahead past the target's block."""

  cache_sharding = None  # where the cache lies on a mesh (`partitioning.cache_sharding`; a static field of
  #                       subclasses that have one); None = one device
  cache_name: ClassVar[str] = "draft"  # how errors name the cache

  @property
  def cache_config(self) -> ModelConfig | None:
    """The config of the drafter's own cache, None when it has none."""
    return None

  def lookahead(self, k: int) -> int:
    """Positions a round writes past the target's committed length minus one (K - 1 for a chain)."""
    return k - 1

  @classmethod
  def check_tree_children(cls, settings: DrafterSettings) -> None:
    error = children_error(settings.tree_children)
    if error:
      raise ConfigError(f"config.{error}")

  def propose(self, state: Any, target_cache: KVCache, pending_B: jax.Array, sampling: SamplingParams, key: jax.Array,
              plan: RoundPlan) -> tuple[Proposal, Any, KVCache]:
    """Drafts the drafter's shape with its own cache (`Shape.propose`: the hook for a chain, a static
    tree or a dynamic tree); the target's cache is untouched."""
    proposal, state = self.shape.propose(self, state, pending_B, sampling, key, plan)
    return proposal, state, target_cache

  def commit(self, state: Any, proposal: Proposal, num_committed_B: jax.Array,
             target_features_BxK1xF: jax.Array) -> Any:
    return self.shape.commit(self, state, proposal, num_committed_B, target_features_BxK1xF)

  def propose_chain(self, state: Any, pending_B: jax.Array, sampling: SamplingParams, key: jax.Array,
                    plan: RoundPlan) -> tuple[Proposal, Any]:
    """`propose` for a chain: (the proposal, the state)."""
    raise NotImplementedError(f"{type(self).__name__} must define propose_chain or propose")

  def commit_chain(self, state: Any, proposal: Proposal, num_committed_B: jax.Array,
                   target_features_BxK1xF: jax.Array) -> Any:
    """`commit` after a chain's round (and, by default, after a tree's: its accepted path is a chain)."""
    return state

  def commit_static(self, state: Any, proposal: Proposal, num_committed_B: jax.Array,
                    target_features_BxK1xF: jax.Array) -> Any:
    return self.commit_chain(state, proposal, num_committed_B, target_features_BxK1xF)

  def commit_dynamic(self, state: Any, proposal: Proposal, num_committed_B: jax.Array,
                     target_features_BxK1xF: jax.Array) -> Any:
    return self.commit_chain(state, proposal, num_committed_B, target_features_BxK1xF)

  def storage(self, batch_size: int, max_len: int) -> KVCache | None:
    config = self.cache_config
    return None if config is None else init_cache(config, batch_size, max_len, self.cache_sharding)

  def storage_of(self, state: Any) -> KVCache | None:
    return None if self.cache_config is None else state.cache

  def check_fits(self, storage: KVCache | None, prompt_lengths_B: np.ndarray, max_new_tokens: int, k: int) -> None:
    if storage is None:
      return  # it writes only inside the target's block, which the target's own check covers
    if storage.batch_size != len(prompt_lengths_B):
      raise ValueError(f"{self.cache_name} cache has {storage.batch_size} rows for {len(prompt_lengths_B)} prompts")
    if self.tree is not None:
      self.tree.check_fits(storage.max_len, "draft cache")
    generation.check_fits(f"speculative generate ({self.cache_name})", prompt_lengths_B, max_new_tokens,
                          self.lookahead(k), storage.max_len, self.cache_config.max_positions)
