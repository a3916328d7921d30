"""From a decode config to a Drafter, on the host: the config checks of each drafter (before anything
loads), the draft model's compatibility and restricted head, and each drafter's cost ratio c.

  drafter = "model"       a small model with the target's tokenizer (`draft`, `draft_vocab`,
                          `draft_stop_threshold`)
  drafter = "ngram"       prompt lookup: the continuation of the longest earlier match of the history's
                          suffix (`ngram_min` .. `ngram_max`); no model, c = 0
  drafter = "layer_skip"  the target's own layers `draft_layers` (self-speculation); no second model
  drafter = "eagle"       a trained EAGLE head (`draft` = its directory, specjax's or EAGLE-3's layout,
                          `speculative.eagle_io`) reading the target's hidden states; `draft_vocab` restricts
                          the target's head it drafts through, unless the head brings its own vocabulary
"""

from __future__ import annotations

from typing import Callable

import ml_collections

from specjax import costs, draft_vocab, partitioning
from specjax.errors import ConfigError
from specjax.models import registry
from specjax.models.load import LoadedModel
from specjax.speculative.drafters.draft_head import DraftHead, restrict_head
from specjax.speculative.drafters.base import Drafter
from specjax.speculative.drafters.eagle import EagleDrafter
from specjax.speculative.drafters.eagle_io import load_head
from specjax.speculative.drafters.layer_skip import LayerSkipDrafter, parse_layers
from specjax.speculative.drafters.model import ModelDrafter
from specjax.speculative.drafters.ngram import NgramDrafter, is_spines
from specjax.speculative.trees.tree import Tree, parse
from specjax.speculative.trees.drafting import CHILDREN

DRAFTERS = ("model", "ngram", "layer_skip", "eagle")


def check_config(cfg: ml_collections.ConfigDict) -> None:
  """Raises `ConfigError` naming the field for drafter settings that cannot work (before any load)."""
  if cfg.drafter not in DRAFTERS:
    raise ConfigError(f"unknown config.drafter {cfg.drafter!r}; expected one of {', '.join(DRAFTERS)}")
  if needs_draft_model(cfg) and not cfg.draft:
    raise ConfigError("config.draft is empty but config.drafter is 'model' (or choose drafter 'ngram' or "
                      "'layer_skip', which need no draft model)")
  if cfg.mode == "speculative" and cfg.drafter == "eagle" and not cfg.draft:
    raise ConfigError("config.draft is empty but config.drafter is 'eagle': give the head's directory")
  if int(cfg.draft_vocab) != cfg.draft_vocab or cfg.draft_vocab < 0:
    raise ConfigError(f"config.draft_vocab must be an integer >= 0 (0 = the full vocabulary), got "
                      f"{cfg.draft_vocab}")
  if int(cfg.ngram_min) != cfg.ngram_min or cfg.ngram_min < 1:
    raise ConfigError(f"config.ngram_min must be an integer >= 1, got {cfg.ngram_min}")
  if int(cfg.ngram_max) != cfg.ngram_max or cfg.ngram_max < cfg.ngram_min:
    raise ConfigError(f"config.ngram_max must be an integer >= config.ngram_min ({cfg.ngram_min}), got "
                      f"{cfg.ngram_max}")
  if not 0.0 <= cfg.draft_stop_threshold < 1.0:
    raise ConfigError(f"config.draft_stop_threshold must be in [0, 1) (0 = off), got {cfg.draft_stop_threshold}")
  tree = config_tree(cfg)
  if tree is not None and cfg.drafter not in ("model", "ngram", "eagle"):
    raise ConfigError(f"config.tree is set but config.drafter is {cfg.drafter!r}: only the model, n-gram and "
                      f"eagle drafters draft trees")
  if tree is not None and cfg.drafter == "ngram" and not (isinstance(tree, Tree) and is_spines(tree)):
    raise ConfigError(f"config.tree {cfg.tree!r}: the n-gram drafter drafts spines, (b, 1, ..., 1): its b best "
                      f"matches, each continued the tree's depth")
  if tree is not None and cfg.draft_stop_threshold:
    raise ConfigError("config.tree and config.draft_stop_threshold exclude each other: a tree drafter does "
                      "not stop early")
  if cfg.tree_children not in CHILDREN:
    raise ConfigError(f"config.tree_children must be one of {CHILDREN}, got {cfg.tree_children!r}")
  if cfg.mode == "speculative" and cfg.drafter == "layer_skip":
    try:
      parse_layers(cfg.draft_layers, n_layers=2**31)  # the syntax now; the range once the target is known
    except ValueError as e:
      raise ConfigError(f"config.{e}") from None


def config_tree(cfg: ml_collections.ConfigDict) -> Tree | None:
  """The static tree of `config.tree` (None for a chain); a malformed one is a `ConfigError`."""
  try:
    return parse(cfg.tree)
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None


def draft_tokens_per_round(cfg: ml_collections.ConfigDict) -> int:
  """K: the most draft tokens a round can accept (the tree's depth when `config.tree` is set)."""
  tree = config_tree(cfg)
  return cfg.k if tree is None else tree.max_depth


def verify_width(cfg: ml_collections.ConfigDict) -> int:
  """The tokens one verify pass feeds: K + 1, or the tree's nodes and root."""
  tree = config_tree(cfg)
  return cfg.k + 1 if tree is None else tree.num_nodes


def needs_draft_model(cfg: ml_collections.ConfigDict) -> bool:
  return cfg.mode == "speculative" and cfg.drafter == "model"


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
  """The acceptance ratio compares probabilities of the same token ids: the tokenizers must agree on
  every id both heads score. The heads may differ in size (padding rows, e.g. Qwen2.5-0.5B's 151,936
  against Qwen2.5-7B's 152,064): the acceptance rule gives the smaller one probability 0 beyond it."""
  shared = min(draft.config.vocab_size, target.config.vocab_size)
  if draft.tokenizer.fingerprint(below=shared) != target.tokenizer.fingerprint(below=shared):
    raise ValueError(f"draft {draft.name} and target {target.name} have different tokenizers: some id "
                     f"below {shared} (the range both heads score) maps to different tokens")


def restricted_draft_head(size: int, corpus_source: str, target: LoadedModel, draft: LoadedModel,
                          log: Callable[[str], None] = print) -> tuple[DraftHead | None, float | None]:
  """The draft's head restricted to the `size` tokens most frequent in `corpus_source` (stop tokens
  included; `config.draft_vocab` and `draft_vocab_corpus`), and the share of the corpus's tokens it
  covers; (None, None) for size 0, the full head."""
  if not size:
    return None, None
  log(f"ranking tokens of {corpus_source!r} for a {size}-token draft head ...")
  counts_V = draft_vocab.corpus_token_counts(target.tokenizer, corpus_source, draft.config.vocab_size,
                                             registry.cache_dir())
  tokens_N = draft_vocab.most_frequent(counts_V, size, always=target.tokenizer.eos_ids)
  coverage = float(counts_V[tokens_N].sum() / max(counts_V.sum(), 1))
  log(f"the draft head scores {len(tokens_N)} of {draft.config.vocab_size} tokens, {coverage:.2%} of "
      f"the corpus's tokens")
  return restrict_head(draft.config, draft.params, tokens_N), coverage


def build(cfg: ml_collections.ConfigDict, target: LoadedModel, draft: LoadedModel | None,
          log: Callable[[str], None] = print) -> tuple[Drafter, dict]:
  """The drafter of `cfg` for `target` (with `draft` loaded when `needs_draft_model(cfg)`), and facts
  to record with the results (the restricted head's corpus coverage, a tree's node count)."""
  tree = config_tree(cfg)
  if cfg.drafter == "model":
    if draft is None:
      raise ValueError("drafter 'model' needs a loaded draft model")
    check_compatible(target, draft)
    head, coverage = restricted_draft_head(cfg.draft_vocab, cfg.draft_vocab_corpus, target, draft, log)
    drafter = ModelDrafter(draft.config, draft.params, head, stop_threshold=cfg.draft_stop_threshold,
                           cache_sharding=partitioning.cache_sharding(draft.config, draft.part), tree=tree,
                           tree_children=cfg.tree_children)
    info = {"draft_vocab_coverage": coverage}
  elif cfg.drafter == "ngram":
    drafter = NgramDrafter(vocab_size=target.config.vocab_size, ngram_min=cfg.ngram_min,
                           ngram_max=cfg.ngram_max, tree=tree)
    info = {}
  elif cfg.drafter == "eagle":
    config, params, vocab = load_head(cfg.draft, target.config)
    coverage = None
    if vocab is None:
      vocab, coverage = restricted_draft_head(cfg.draft_vocab, cfg.draft_vocab_corpus, target, target, log)
    elif cfg.draft_vocab not in (0, vocab.tokens_N.shape[0]):
      raise ConfigError(f"config.draft_vocab {cfg.draft_vocab}: the head {cfg.draft} brings its own restricted "
                        f"vocabulary of {vocab.tokens_N.shape[0]} tokens (set draft_vocab to 0 or to that size)")
    drafter = EagleDrafter(config, params, target.config, target.params, vocab,
                           cache_sharding=partitioning.cache_sharding(config.block, target.part), tree=tree,
                           tree_children=cfg.tree_children)
    info = {"eagle_feature_layers": list(config.feature_layers), "draft_vocab_coverage": coverage}
  else:
    try:
      layers = parse_layers(cfg.draft_layers, target.config.n_layers)
    except ValueError as e:
      raise ConfigError(f"config.{e}") from None
    drafter = LayerSkipDrafter(target.config, target.params, layers)
    info = {"draft_layers": list(layers)}
  drafter.check(target.config)
  if tree is not None:
    info["tree_nodes"] = tree.num_nodes - 1
  return drafter, info


def cost_ratio(drafter: Drafter, target: LoadedModel, batch_size: int, repeats: int) -> float:
  """The drafter's c: one draft pass's time over one target pass's (`costs.cost_ratio`), from what the
  drafter says a pass runs (`Drafter.draft_pass`); 0 for a lookup that runs no model."""
  draft = drafter.draft_pass()
  if draft is None:
    return 0.0
  return costs.cost_ratio(target.config, target.params, draft.config, draft.params, batch_size, repeats,
                          head=draft.head, draft_layers=draft.layers)
