"""What a student is trained on, position by position: the training row itself (`PlainLayout`, the null
layout every draft model's run uses) or the row with PARD's mask blocks (`PardLayout`, `student.init =
"parallel"`: a draft for `drafters.parallel`).

PARD (arXiv 2504.18583) trains a draft to predict K tokens from one pass over [context, MASK x (K - 1)].
One row of T tokens trains every anchor at once as a tree (the model's tree attention: each node sits at
a position and sees its ancestors): the T real tokens form a chain, and below anchor a hangs a chain of
masks m_1 .. m_{K-1}, m_j at position a + j seeing x_1 .. x_a and m_1 .. m_j, exactly what the decode
pass [.., pending = x_a, MASK, ..] shows the draft. Real token a is trained toward the target's
distribution at a (q_1, the usual next-token loss), mask m_j toward the target's at a + j (q_{j+1}:
the token j + 1 after the anchor, which the draft predicts without seeing the ones between).

Conditional drop (COD): the masks of depth j hang below a fraction r^j of the anchors (nested: a chain
stops where its anchor is dropped), so the row holds about T (1 + r + .. + r^{K-1}) nodes instead of TK.
Which anchors is a fixed seeded ranking of positions (the layout is static, one compiled program): the
rows are random windows of text, so every position is a random anchor.

The mask token is a row appended to the vocabulary (id V, the target's vocabulary size): the draft's
embedding and output head grow by one row (initialised to the mean row), learned like the others; the
target gives it probability 0.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import Params, forward

NEVER = -1e30  # the target's logit of the mask token: probability 0, finite (no 0 x inf in the divergences)


def dense(config: ModelConfig) -> ModelConfig:
  """Dense attention: every key is live, and the blockwise loop's data-dependent trip count cannot be
  reverse-differentiated."""
  return config.replace(attention="dense")


@dataclasses.dataclass(frozen=True)
class PlainLayout:
  """The null layout: the student reads the row and is trained at every position toward the target's
  distribution there (one draft position)."""

  positions: int = 1  # draft positions whose acceptance the evaluation reports

  def student_logits(self, config: ModelConfig, params: Params, tokens_BxT: jax.Array) -> jax.Array:
    """Float32 logits [B, N, W] of the student's N nodes (here N = T)."""
    B, T = tokens_BxT.shape
    return forward(dense(config), params, tokens_BxT, init_cache(config, B, T))[0]

  def teacher_logits(self, teacher_BxTxV: jax.Array, width: int) -> jax.Array:
    """The target's logits each node is trained toward [B, N, W] (W >= V: the student's ids beyond the
    target's get probability 0)."""
    return jnp.pad(teacher_BxTxV, ((0, 0), (0, 0), (0, width - teacher_BxTxV.shape[-1])), constant_values=NEVER)

  def weights(self, mask_BxT: jax.Array) -> jax.Array:
    """[B, N] float32: which nodes' predictions count (the row's loss mask, moved to the nodes)."""
    return mask_BxT.astype(jnp.float32)

  def position_of(self, seq_len: int) -> np.ndarray:
    """[N] int: each node's draft position (0 = q_1, the real tokens)."""
    return np.zeros(seq_len, np.int32)


@dataclasses.dataclass(frozen=True)
class PardLayout(PlainLayout):
  """A row of T tokens and its COD-dropped mask chains, as a static tree of N nodes (see the module
  docstring): hashable, a static argument of the compiled steps, and a tree the model's attention reads
  (`first`, `depth`, `key_depth`, `ancestor_mask()`)."""

  mask_id: int = 0  # the mask token (the target's vocabulary size: the appended row)
  source: tuple[int, ...] = ()  # [N]: the row position whose target distribution node n learns (a + j)
  step: tuple[int, ...] = ()  # [N]: j, 0 for the real tokens, 1 .. K - 1 for the masks (q_{j+1})
  parent: tuple[int, ...] = ()  # [N]: the node each one follows (-1 for the first token)
  first: int = 0  # the tree chunk starts at its first node (`attention_mask`)

  @property
  def depth(self) -> tuple[int, ...]:
    """Each node's position in the row (a + j for mask m_j of anchor a)."""
    return self.source

  @property
  def key_depth(self) -> tuple[int, ...]:
    return self.source

  @functools.cache
  def ancestor_mask(self) -> np.ndarray:
    """[N, N] bool: node n sees itself and the nodes it follows."""
    n = len(self.parent)
    mask = np.eye(n, dtype=bool)
    for node in range(1, n):
      if self.parent[node] >= 0:
        mask[node] |= mask[self.parent[node]]
    return mask

  def student_logits(self, config: ModelConfig, params: Params, tokens_BxT: jax.Array) -> jax.Array:
    B, T = tokens_BxT.shape
    masks_BxM = jnp.full((B, len(self.parent) - T), self.mask_id, tokens_BxT.dtype)
    nodes_BxN = jnp.concatenate([tokens_BxT, masks_BxM], axis=1)
    return forward(dense(config), params, nodes_BxN, init_cache(config, B, len(self.parent)), tree=self)[0]

  def teacher_logits(self, teacher_BxTxV: jax.Array, width: int) -> jax.Array:
    return super().teacher_logits(teacher_BxTxV[:, np.asarray(self.source)], width)

  def weights(self, mask_BxT: jax.Array) -> jax.Array:
    return mask_BxT[:, np.asarray(self.source)].astype(jnp.float32)

  def position_of(self, seq_len: int) -> np.ndarray:
    return np.asarray(self.step, np.int32)


def pard_layout(seq_len: int, k: int, keep: float, mask_id: int, seed: int = 0) -> PardLayout:
  """The layout of rows of `seq_len` tokens for K-token blocks, masks of depth j below a fraction keep^j
  of the anchors (1 = every anchor: no drop), ranked once by `seed`."""
  if not (k >= 2 and 0.0 < keep <= 1.0):
    raise ValueError(f"a PARD layout needs K >= 2 and a keep fraction in (0, 1], got K = {k}, keep = {keep}")
  rank_T = np.random.default_rng(seed).permutation(seq_len)
  source, step, parent = list(range(seq_len)), [0] * seq_len, list(range(-1, seq_len - 1))
  above = {a: a for a in range(seq_len)}  # each anchor's deepest node so far
  for j in range(1, k):
    kept = int(np.ceil(keep**j * seq_len))
    for a in range(seq_len - j):
      if rank_T[a] < kept:
        source.append(a + j)
        step.append(j)
        parent.append(above[a])
        above[a] = len(parent) - 1
  return PardLayout(positions=k, mask_id=mask_id, source=tuple(source), step=tuple(step), parent=tuple(parent))


def with_mask_row(config: ModelConfig, params: Params) -> tuple[ModelConfig, Params]:
  """The draft with one more vocabulary row, the mask token (`mask_id`), its embedding (and untied output
  head) row the mean of the others; per-layer layout in and out."""
  grow = lambda rows_VxD: jnp.concatenate([rows_VxD, jnp.mean(rows_VxD, axis=0, keepdims=True)], axis=0)
  grown = dict(params, embed={**params["embed"], "embedding": grow(params["embed"]["embedding"])})
  if "lm_head" in params:
    grown["lm_head"] = {**params["lm_head"], "weight": grow(params["lm_head"]["weight"])}
  return config.replace(vocab_size=config.vocab_size + 1), grown


def mask_id(config: ModelConfig) -> int:
  """A PARD draft's mask token: its last vocabulary row (`with_mask_row`)."""
  return config.vocab_size - 1
