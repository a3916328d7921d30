"""EAGLE-style draft heads: one decoder block that drafts from the target's own hidden states (Li et al.,
EAGLE 2024; EAGLE-3 2025), and the `EagleDrafter` that runs it inside the speculative loop.

The head. At position t it reads the pair (target feature f_t, next token x_{t+1}) and predicts x_{t+2}:
  fused_t = fc(f_t)                          EAGLE-3: f_t = [h_low ; h_mid ; h_high] [3D] -> [D]
                                             EAGLE-1: f_t = the final-norm hidden state [D], no fc
  x = [input_norm(embed(x_{t+1})) ; hidden_norm(fused_t)]        [2D]: the block's q/k/v read 2D
  h = fused_t + attn(x);  out_t = h + mlp(mlp_norm(h))           [D]: the head's own next feature
  logits = output head(final_norm(out_t))
We keep EAGLE-3's block as it is (q/k/v projections of input width 2D, the residual stream starting at the
fused feature) rather than projecting [2D] -> [D] first: published heads load as a plain copy
(`eagle_io`). The token embedding and the output head are the target's (shared, never trained); the head
may instead score a subset of the vocabulary through its own rows (`DraftHead`, EAGLE-3's `draft_vocab`).
The feature layers name blocks of the target: f_t holds the residual stream *after* each of them
(`forward_features`); EAGLE-3's (low, middle, high) choice for L layers is (1, L // 2 - 1, L - 4)
(`eagle3_layers`: the streams entering its blocks 2, L // 2 and L - 3).

Drafting. The target's cache holds x_0 .. x_{n-1} (x_n is pending); the head's cache holds the pairs
t = 0 .. n - 2, built from the *target's* features, and `feature` holds fused f_{n-1}. A proposal
feeds (f_{n-1}, x_n), draws d_1, then feeds its own output with each draft token (out, d_i) -> d_{i+1}:
K head passes, written beyond the head's length and never committed. After the target verifies
[x_n, d_1 .. d_K] (features g_0 .. g_K), `commit` feeds the pairs (f_{n-1}, x_n), (g_0, d_1) ..
(g_{K-1}, d_K) in one pass and keeps the first n + 1 of a row that committed n + 1 tokens; g_n becomes
the new `feature`. The head's history is always the target's features, never its own guesses.

Trees: a static `tree` is drafted level by level (a node reads its parent's head output and its own
token, attending to the head's history and its ancestors); a dynamic one (`DynamicSpec`, EAGLE-2) grows
each row's tree from the root pass (f_{n-1}, x_n), one frontier chunk per depth, its nodes reading their
parents' head outputs the same way (`dynamic_tree.grow_dynamic_tree`). After verification the accepted
path is committed like a chain, from the target's features along it, so nothing needs compacting.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from specjax import partitioning
from specjax.errors import ConfigError
from specjax.models import attention, matmul
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache, init_cache
from specjax.models.transformer import (MLP, Attention, Norm, Params, cache_attention, prefill_features,
                                        rotary_tables)
from specjax.sampling import SamplingParams, tokens_and_probabilities
from specjax.speculative.drafters.base import DraftPass, DrafterSettings, ModelBackedDrafter, draft_chain
from specjax.speculative.drafters.draft_head import (DraftHead, add_vocab_options, check_vocab_options, draft_logits,
                                                     restricted_draft_head)
from specjax.speculative.trees.dynamic import DynamicSpec, DynamicTree, grow_dynamic_tree
from specjax.speculative.proposal import Proposal, full
from specjax.speculative.trees.tree import Tree
from specjax.speculative.trees.drafting import children_error, grow_tree, spine_or_whole

if TYPE_CHECKING:
  from specjax.models.load import LoadedModel


@dataclasses.dataclass(frozen=True)
class EagleConfig:
  """The static shape of a head (hashable: a static argument under `jax.jit`)."""

  block: ModelConfig  # its decoder block: 1 layer of the target's width, heads and MLP (q/k/v read 2D)
  feature_layers: tuple[int, ...] = ()  # target blocks whose outputs are fused (EAGLE-3: 3); () = EAGLE-1

  @property
  def feature_width(self) -> int:
    """F: the width of the target features the head reads (D when it reads the final-norm hidden state)."""
    return self.block.d_model * max(len(self.feature_layers), 1)


def eagle3_layers(n_layers: int) -> tuple[int, ...]:
  """EAGLE-3's low, middle and high feature layers of an `n_layers`-layer target (blocks after which
  the residual stream is read); at least 4 layers."""
  if n_layers < 4:
    raise ValueError(f"EAGLE-3 features need a target of at least 4 layers, got {n_layers}")
  return tuple(sorted({1, n_layers // 2 - 1, n_layers - 4}))


def head_config(target_config: ModelConfig, feature_layers: tuple[int, ...] = ()) -> EagleConfig:
  """A head for `target_config`: one block like the target's (width, heads, MLP, norms, RoPE)."""
  block = target_config.with_depth(1).replace(scan_layers=False, remat=False)
  return EagleConfig(block=block, feature_layers=tuple(feature_layers))


class EagleLayer(nn.Module):
  """The head's block: attention over [embedding ; feature] (2D wide), residual stream from the feature.
  Drafting and training run this one block; they differ only in its attention core (see
  `transformer.Attention`): the head's KV cache when drafting, the training-time test's chains when
  training (`distill.eagle_steps`)."""

  config: ModelConfig
  core: Callable = cache_attention  # the attention core and its state (`cache`): the head's KV cache by default

  @nn.compact
  def __call__(self, embed_BxTxD, fused_BxTxD, rotary, cache: KVCache, tree=None):
    cfg = self.config
    x_BxTx2D = jnp.concatenate([Norm(cfg, name="input_norm")(embed_BxTxD),
                                Norm(cfg, name="hidden_norm")(fused_BxTxD)], axis=-1)
    attn_out, cache = Attention(cfg, self.core, name="attn")(x_BxTx2D, rotary, cache, 0, tree)
    h_BxTxD = fused_BxTxD + attn_out
    return h_BxTxD + MLP(cfg, name="mlp")(Norm(cfg, name="mlp_norm")(h_BxTxD)), cache


def init_head_params(config: EagleConfig, key: jax.Array) -> Params:
  """Random head parameters: `fc/weight` [D, F] (EAGLE-3 only), `layer/...`, `final_norm/scale`."""
  block = config.block
  fc_key, layer_key, norm_key = jax.random.split(key, 3)
  x_1x1xD = jnp.zeros((1, 1, block.d_model), block.jnp_dtype)
  rotary = rotary_tables(block, jnp.zeros((1, 1), jnp.int32))
  params = {"layer": EagleLayer(block).init(layer_key, x_1x1xD, x_1x1xD, rotary, init_cache(block, 1, 1))["params"],
            "final_norm": Norm(block).init(norm_key, x_1x1xD)["params"]}
  if config.feature_layers:
    params["fc"] = {"weight": 0.02 * jax.random.normal(fc_key, (block.d_model, config.feature_width),
                                                       block.jnp_dtype)}
  return params


def fuse(config: EagleConfig, params: Params, features_xF: jax.Array) -> jax.Array:
  """Target features [..., F] -> the head's input features [..., D] (EAGLE-3's `fc`; EAGLE-1: as is)."""
  if not config.feature_layers:
    return features_xF.astype(config.block.jnp_dtype)
  weight_DxF = params["fc"]["weight"]
  return matmul.dense(features_xF.astype(weight_DxF.dtype), weight_DxF, config.block.matmul)


def head_forward(config: EagleConfig, params: Params, embedding_VxD: jax.Array, tokens_BxT: jax.Array,
                 fused_BxTxD: jax.Array, cache: KVCache, tree=None, *, positions_BxT: jax.Array | None = None,
                 core: Callable = cache_attention) -> tuple[jax.Array, KVCache]:
  """The head's outputs [B, T, D] (pre-norm: its own next features) for the pairs (fused feature,
  token) at positions `cache.lengths[b] + t` (a tree chunk: `+ depth[t]`, see `attention`), and its
  written (not advanced) cache. Training runs the same block with its own attention `core` (then `cache`
  is that core's state) at explicit `positions_BxT` (`distill.eagle_steps.ttt_unroll`)."""
  if positions_BxT is None:
    positions_BxT = attention.query_positions(cache.lengths, tokens_BxT.shape[1], tree)
  embed_BxTxD = jnp.take(embedding_VxD, tokens_BxT, axis=0).astype(config.block.jnp_dtype)
  return EagleLayer(config.block, core).apply({"params": params["layer"]}, embed_BxTxD, fused_BxTxD,
                                              rotary_tables(config.block, positions_BxT), cache, tree)


def head_logits(config: EagleConfig, params: Params, target_config: ModelConfig, target_params: Params,
                vocab: DraftHead | None, out_xD: jax.Array) -> jax.Array:
  """Float32 logits [..., V] of head outputs: its final norm, then the target's output head (or the
  restricted `vocab` head)."""
  return draft_logits(target_config, target_params, vocab, _final_norm(config, params, out_xD))


def head_scores(config: EagleConfig, params: Params, target_config: ModelConfig, target_params: Params,
                vocab: DraftHead | None, out_xD: jax.Array) -> jax.Array:
  """Float32 logits over the head's own vocabulary: [..., V] through the target's output head, or
  [..., Vd] of a restricted `vocab`'s tokens (no -inf columns: what training computes over)."""
  if vocab is None:
    return head_logits(config, params, target_config, target_params, None, out_xD)
  return vocab.scores(_final_norm(config, params, out_xD))


def _final_norm(config: EagleConfig, params: Params, out_xD: jax.Array) -> jax.Array:
  return Norm(config.block).apply({"params": params["final_norm"]}, out_xD)


def check_head(config: EagleConfig, params: Params, target_config: ModelConfig,
               vocab: DraftHead | None = None) -> None:
  """Raises ValueError unless the head fits the target: widths, vocabulary and feature layers."""
  if config.block.d_model != target_config.d_model:
    raise ValueError(f"the EAGLE head is {config.block.d_model} wide, the target's d_model is "
                     f"{target_config.d_model}: this head was trained for another target")
  bad = [i for i in config.feature_layers if not 0 <= i < target_config.n_layers]
  if bad:
    raise ValueError(f"the EAGLE head reads features after target layers {bad}, but the target has "
                     f"{target_config.n_layers} layers (0..{target_config.n_layers - 1})")
  if list(config.feature_layers) != sorted(set(config.feature_layers)):
    raise ValueError(f"EAGLE feature layers must be ascending and distinct, got {config.feature_layers}")
  if config.feature_layers and params["fc"]["weight"].shape != (config.block.d_model, config.feature_width):
    raise ValueError(f"the head's fc weight is {params['fc']['weight'].shape}, expected "
                     f"{(config.block.d_model, config.feature_width)} for feature layers {config.feature_layers}")
  if vocab is not None and (vocab.vocab_size != target_config.vocab_size
                            or vocab.weight_VdxD.shape[1] != target_config.d_model):
    raise ValueError(f"the head's restricted vocabulary spans {vocab.vocab_size} ids of width "
                     f"{vocab.weight_VdxD.shape[1]}; the target has {target_config.vocab_size} of width "
                     f"{target_config.d_model}")


@flax.struct.dataclass
class EagleState:
  cache: KVCache  # [1, B, S, G, Dh] head cache: pairs (f_t, x_{t+1}) for t < the target's length - 1
  feature: jax.Array  # [B, D] fused target feature f_{n-1} of the target's last cached position
  pending: jax.Array  # [B] int32: the pending token x_n of the last proposal (the first pair `commit` feeds)


class EagleDrafter(ModelBackedDrafter):
  """Drafts K tokens per round with an EAGLE head (see the module docstring)."""

  name: ClassVar[str] = "eagle"
  reads_prompt_features: ClassVar[bool] = True
  cache_name: ClassVar[str] = "EAGLE head"
  config: EagleConfig = flax.struct.field(pytree_node=False)
  params: Params  # the head's own weights (`init_head_params`)
  target_config: ModelConfig = flax.struct.field(pytree_node=False)
  target_params: Params  # the target's: its embedding and output head are shared
  vocab: DraftHead | None = None  # a restricted output head (EAGLE-3's draft vocabulary), None = the target's
  cache_sharding: Any = flax.struct.field(pytree_node=False, default=None)  # the head cache's placement on a mesh
  # Draft this static tree, or a dynamic tree of this budget, each round; None = a chain.
  tree: Tree | DynamicSpec | None = flax.struct.field(pytree_node=False, default=None)
  tree_children: str = flax.struct.field(pytree_node=False, default="iid")  # `tree_drafting.CHILDREN`

  @classmethod
  def config_group(cls) -> ml_collections.ConfigDict:
    return add_vocab_options(ml_collections.ConfigDict())  # used when the head brings no vocabulary of its own

  @classmethod
  def check_config(cls, settings: DrafterSettings) -> None:
    if not settings.draft:
      raise ConfigError("config.draft is empty but config.drafter is 'eagle': give the head's directory")
    check_vocab_options(settings.options, settings.group)
    cls.check_tree_children(settings)

  @classmethod
  def build(cls, settings: DrafterSettings, target: LoadedModel, draft: LoadedModel | None,
            log: Callable[[str], None] = print) -> tuple[EagleDrafter, dict]:
    from specjax.speculative.drafters.eagle_io import load_head  # eagle_io imports this module

    config, params, vocab = load_head(settings.draft, target.config, target.params)
    coverage, size = None, settings.options.vocab
    if vocab is None:
      vocab, coverage = restricted_draft_head(size, settings.options.vocab_corpus, target, target, log)
    elif size not in (0, vocab.tokens_Vd.shape[0]):
      raise ConfigError(f"{settings.field('vocab')} {size}: the head {settings.draft} brings its own restricted "
                        f"vocabulary of {vocab.tokens_Vd.shape[0]} tokens (set it to 0 or to that size)")
    drafter = cls(config, params, target.config, target.params, vocab,
                  cache_sharding=partitioning.cache_sharding(config.block, target.part), tree=settings.tree,
                  tree_children=settings.tree_children)
    return drafter, {"eagle_feature_layers": list(config.feature_layers), "draft_vocab_coverage": coverage}

  @property
  def feature_layers(self) -> tuple[int, ...]:
    return self.config.feature_layers

  @property
  def vocab_size(self) -> int:
    return self.target_config.vocab_size

  @property
  def cache_config(self) -> ModelConfig:
    return self.config.block

  def check(self, target_config: ModelConfig) -> None:
    check_head(self.config, self.params, target_config, self.vocab)
    if self.tree is not None and not isinstance(self.tree, (Tree, DynamicSpec)):
      raise ValueError(f"the EAGLE drafter's tree must be a static Tree or a DynamicSpec, got {self.tree!r}")
    if children_error(self.tree_children):
      raise ValueError(children_error(self.tree_children))

  def draft_pass(self) -> DraftPass:
    """Approximately one head pass: one block of the target's and its output head (the head's q/k/v
    read 2D, not D: a few percent more in a block)."""
    return DraftPass(self.target_config, self.target_params, self.vocab, layers=(0,))

  def lookahead(self, k: int) -> int:
    """`commit` writes K + 1 pairs beyond a length one short of the target's (a tree proposal: N + 1
    nodes; a dynamic tree's proposal: the root and its frontier chunks)."""
    if self.tree is None:
      return k
    return max(k, self.tree.nodes_with_root - 1, self.tree.draft_slots if isinstance(self.tree, DynamicSpec) else 0)

  def _embedding(self) -> jax.Array:
    return self.target_params["embed"]["embedding"]

  def init(self, storage: KVCache, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array,
           target_cache: KVCache) -> EagleState:
    """Prefills the head with the target's features of the prompts, recomputed by a target prefill of
    its own (with a temporary cache of the prompts' size). The loop does not call this: its prefill
    hands the features to `init_from_features`."""
    scratch = init_cache(self.target_config, *prompts_BxP.shape)
    _, features_BxPxF, _ = prefill_features(self.target_config, self.target_params, prompts_BxP,
                                            prompt_lengths_B, scratch, self.feature_layers)
    return self.init_from_features(storage, prompts_BxP, prompt_lengths_B, features_BxPxF)

  def init_from_features(self, storage: KVCache, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array,
                         features_BxPxF: jax.Array) -> EagleState:
    """The state after the right-padded prompts, from the target's features of every prompt position
    [B, P, F] (`prefill_features`): the head's cache holds the pairs (f_t, x_{t+1}), t < length - 1."""
    batch, width = prompts_BxP.shape
    fused_BxPxD = fuse(self.config, self.params, features_BxPxF)
    cache = storage.replace(lengths=jnp.zeros((batch,), jnp.int32))  # whatever it held before
    if width > 1:  # pairs (f_t, x_{t+1}), t < P - 1
      _, cache = head_forward(self.config, self.params, self._embedding(), prompts_BxP[:, 1:],
                              fused_BxPxD[:, :-1], cache)
    last_B = jnp.maximum(prompt_lengths_B - 1, 0)
    return EagleState(cache=cache.advance(last_B),
                      feature=jnp.take_along_axis(fused_BxPxD, last_B[:, None, None], axis=1)[:, 0],
                      pending=jnp.zeros((batch,), jnp.int32))

  def _propose_tree(self, state: EagleState, pending_B: jax.Array, sampling: SamplingParams,
                    key: jax.Array, depth: jax.Array | None, spine: jax.Array | None) -> Proposal:
    """A static tree drawn level by level: the root pairs (f_{n-1}, x_n), every other node (its parent's
    head output, its token), each level one tree-masked head pass written beyond the head's length
    (scratch: `commit` rewrites the accepted path from the target's features). Cut at `depth` (None:
    whole; the adaptive policy's choice): that many passes; where `spine` holds, only the cut's spine
    (one node a pass: `spine_or_whole`)."""
    batch = pending_B.shape[0]

    def draw(tree: Tree, cache: KVCache):
      parent_N1 = np.maximum(np.asarray(tree.parent), 0)

      def feed_level(carry, tokens_BxLv, level, depth):
        cache, outs_BxN1xD = carry
        nodes = np.arange(level.first, level.first + level.count)
        fused_BxLvxD = state.feature[:, None] if depth == 0 else outs_BxN1xD[:, parent_N1[nodes]]
        out_BxLvxD, cache = head_forward(self.config, self.params, self._embedding(), tokens_BxLv, fused_BxLvxD,
                                         cache, tree=level)
        return out_BxLvxD, (cache, outs_BxN1xD.at[:, nodes].set(out_BxLvxD))

      def head(out_BxLvxD):
        return head_logits(self.config, self.params, self.target_config, self.target_params, self.vocab, out_BxLvxD)

      outs_BxN1xD = jnp.zeros((batch, tree.nodes_with_root, self.config.block.d_model), self.config.block.jnp_dtype)
      tokens_BxN, probs_BxNxW, (cache, _) = grow_tree(tree, self.tree_children, pending_B, sampling, key, feed_level,
                                                      head, (cache, outs_BxN1xD), depth)
      return cache, (tokens_BxN, probs_BxNxW)

    _, (tokens_BxN, probs_BxNxW) = spine_or_whole(self.tree, spine, draw, state.cache)
    return full(tokens_BxN, probs_BxNxW).replace(tree=self.tree,
                                                 calls=jnp.int32(self.tree.max_depth if depth is None else depth))

  def draft_dynamic_tree(self, state: EagleState, pending_B: jax.Array, sampling: SamplingParams
                         ) -> tuple[jax.Array, DynamicTree, jax.Array, jax.Array]:
    """A dynamic tree: the root pass (f_{n-1}, x_n) gives the root's logits, then each frontier chunk
    feeds (its nodes' parents' head outputs, their tokens), written after the root beyond the head's
    length (scratch, as for a static tree): Dt head passes. Returns the tokens [B, N], the trees, each
    node's frontier slot [B, N + 1] (-1: not fed) and the head outputs of the frontier slots [B, Fr, D]."""
    spec, batch = self.tree, pending_B.shape[0]
    root_Bx1xD, cache = head_forward(self.config, self.params, self._embedding(), pending_B[:, None],
                                     state.feature[:, None], state.cache)
    root_logits_BxV = head_logits(self.config, self.params, self.target_config, self.target_params, self.vocab,
                                  root_Bx1xD[:, 0])

    def score_frontier(carry, chunk_Bxb, frontier, parent_slots_Bxb):
      cache, outs_BxFrxD = carry  # head outputs of the fed frontier slots
      parents_BxbxD = jnp.take_along_axis(outs_BxFrxD, jnp.maximum(parent_slots_Bxb, 0)[:, :, None], axis=1)
      fused_BxbxD = jnp.where((parent_slots_Bxb >= 0)[:, :, None], parents_BxbxD, root_Bx1xD)
      out_BxbxD, cache = head_forward(self.config, self.params, self._embedding(),
                                      jnp.minimum(chunk_Bxb, self.vocab_size - 1), fused_BxbxD, cache, tree=frontier)
      logits_BxbxV = head_logits(self.config, self.params, self.target_config, self.target_params, self.vocab,
                                 out_BxbxD)
      return logits_BxbxV, (cache, outs_BxFrxD.at[:, frontier.first:frontier.first + frontier.count].set(out_BxbxD))

    outs_BxFrxD = jnp.zeros((batch, (spec.depth - 1) * spec.expand, self.config.block.d_model),
                            self.config.block.jnp_dtype)
    tokens_BxN, tree, slots_BxN1, (_, outs_BxFrxD) = grow_dynamic_tree(
        spec, root_logits_BxV, sampling, score_frontier, (cache.advance(jnp.ones_like(pending_B)), outs_BxFrxD))
    return tokens_BxN, tree, slots_BxN1, outs_BxFrxD

  def propose(self, state: EagleState, target_cache: KVCache, pending_B: jax.Array, sampling: SamplingParams,
              key: jax.Array, k: int, wanted_B: jax.Array | None = None,
              spine: jax.Array | None = None) -> tuple[Proposal, EagleState, KVCache]:
    if isinstance(self.tree, DynamicSpec):
      tokens_BxN, tree, _, _ = self.draft_dynamic_tree(state, pending_B, sampling)
      proposal = full(tokens_BxN, calls=self.tree.depth).replace(dynamic_tree=tree)
      return proposal, state.replace(pending=pending_B), target_cache
    if self.tree is not None:
      proposal = self._propose_tree(state, pending_B, sampling, key, None if wanted_B is None else jnp.max(wanted_B),
                                    spine)
      return proposal, state.replace(pending=pending_B), target_cache

    def step(carry, step_key):
      cache, fused_BxD, token_B = carry
      out_Bx1xD, cache = head_forward(self.config, self.params, self._embedding(), token_B[:, None],
                                      fused_BxD[:, None], cache)
      logits_BxV = head_logits(self.config, self.params, self.target_config, self.target_params, self.vocab,
                               out_Bx1xD[:, 0])
      next_B, probs_BxV = tokens_and_probabilities(step_key, logits_BxV, sampling)
      return (cache.advance(jnp.ones_like(next_B)), out_Bx1xD[:, 0], next_B), (next_B, probs_BxV)

    (cache, _, _), proposal = draft_chain(step, (state.cache, state.feature, pending_B), key, k, wanted_B)
    # The pairs written beyond the head's length are scratch: `commit` rewrites them from the target. The
    # state keeps the written cache (at its old length): dropping it would make XLA copy the whole cache
    # so that the old one survives the chain.
    return proposal, state.replace(cache=cache.replace(lengths=state.cache.lengths), pending=pending_B), target_cache

  def commit(self, state: EagleState, proposal: Proposal, num_committed_B: jax.Array,
             target_hidden_BxK1xF: jax.Array) -> EagleState:
    fused_BxK1xD = fuse(self.config, self.params, target_hidden_BxK1xF)
    features_BxK1xD = jnp.concatenate([state.feature[:, None], fused_BxK1xD[:, :-1]], axis=1)
    tokens_BxK1 = jnp.concatenate([state.pending[:, None], proposal.tokens], axis=1)
    _, cache = head_forward(self.config, self.params, self._embedding(), tokens_BxK1, features_BxK1xD,
                            state.cache)
    newest_BxD = jnp.take_along_axis(fused_BxK1xD, jnp.maximum(num_committed_B - 1, 0)[:, None, None],
                                     axis=1)[:, 0]
    return state.replace(cache=cache.advance(num_committed_B),
                         feature=jnp.where((num_committed_B > 0)[:, None], newest_BxD, state.feature))
