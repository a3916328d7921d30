"""The suffix drafter's pool: P token ids of earlier sequences, oldest first, each followed by a separator
(-1), and its index: a suffix array of the pool's reversed windows and a merge-sort tree of recency
over it, so that a round finds a context's longest match in the pool, and the match's M latest
occurrences, in O(log P) probes instead of a pass over the pool's P tokens.

A pool position j is *indexed* when a token follows it (c[j] and c[j + 1] are tokens, not separators).
Its window is c[j], c[j - 1], ..., c[j - N + 1] (N = max_match), cut to -1 from the first separator or
the pool's start on, so that no match crosses a sequence boundary. `order` lists the indexed positions
by window, lexicographically, then -1 up to P' = P rounded up to a power of two. A context's suffix
read backwards, s (-2 past its start: equal to nothing), then shares its longest prefix with a
neighbour of its insertion point, and the positions whose windows share the first n tokens of s are
one range of `order`. `latest[l]` is `order` with each aligned block of 2^l entries sorted latest
first: any range is at most two blocks per level, whose first M entries hold the range's M latest
positions.

The index is a function of the tokens, built with them by `Pool.of` whenever they change (between
calls, never inside the loop): O(P log^2 P) on the device, [log2 P' + 1, P'] int32 in memory.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

SEPARATOR = -1  # ends every sequence in the pool: equal to no token, so no match crosses it
CUT = -1  # a window's tokens past a separator or the pool's start (below every token id)


def empty_pool(capacity: int) -> jax.Array:
  """Pool tokens of `capacity` holding nothing: [Pl] int32, all separators."""
  return jnp.full((capacity,), SEPARATOR, jnp.int32)


@jax.jit
def appended(pool_Pl: jax.Array, prompts_BxP: jax.Array, prompt_lengths_B: jax.Array, tokens_BxO: jax.Array,
             counts_B: jax.Array) -> jax.Array:
  """`pool_Pl` with each row's prompt then output (its first `counts_B[b]` tokens) appended, row by row,
  each followed by a separator; the oldest tokens fall off the front. A row of zero length adds nothing."""
  batch, width = prompts_BxP.shape
  sequences_BxT = jnp.concatenate([prompts_BxP, tokens_BxO], axis=1).astype(jnp.int32)
  column_1xT = jnp.arange(sequences_BxT.shape[1])[None, :]
  in_prompt_BxT = column_1xT < prompt_lengths_B[:, None]
  output_column_BxT = column_1xT - width
  in_output_BxT = (output_column_BxT >= 0) & (output_column_BxT < counts_B[:, None])
  sizes_B = prompt_lengths_B + counts_B
  rows_used_B = sizes_B > 0
  starts_B = jnp.cumsum(jnp.where(rows_used_B, sizes_B + 1, 0)) - jnp.where(rows_used_B, sizes_B + 1, 0)
  # Where each token lands in the appended block: its row's start plus its index in prompt + output.
  index_BxT = jnp.where(in_prompt_BxT, column_1xT, prompt_lengths_B[:, None] + output_column_BxT)
  block = batch * (sequences_BxT.shape[1] + 1)
  slots_BxT = jnp.where(in_prompt_BxT | in_output_BxT, starts_B[:, None] + index_BxT, block)
  block_Z = jnp.full((block,), SEPARATOR, jnp.int32).at[slots_BxT].set(sequences_BxT, mode="drop")
  used = jnp.sum(jnp.where(rows_used_B, sizes_B + 1, 0))
  capacity = pool_Pl.shape[0]
  return jax.lax.dynamic_slice(jnp.concatenate([pool_Pl, block_Z]), (used,), (capacity,))


def windows(tokens_Pl: jax.Array, positions_Z: jax.Array, width: int) -> jax.Array:
  """The reversed windows ending at `positions_Z` ([Z, Mt] int32): tokens c[j], c[j - 1], ..., CUT from
  the first separator (any negative id) or the pool's start on."""
  back_ZxMt = positions_Z[:, None] - jnp.arange(width)[None, :]
  read_ZxMt = jnp.where(back_ZxMt >= 0, tokens_Pl[jnp.maximum(back_ZxMt, 0)], CUT)
  return jnp.where(jnp.cumsum(read_ZxMt < 0, axis=1) > 0, CUT, read_ZxMt)


@flax.struct.dataclass
class Pool:
  """The pool's `tokens` ([Pl] int32) and their index: `latest`, `order` (level 0) and the merge-sort
  levels of recency over it ([L + 1, P'] int32, -1 = no entry), and `size`, the number of indexed
  positions (a scalar int32). Built by `Pool.of`, so that the index always belongs to the tokens."""

  tokens: jax.Array
  latest: jax.Array
  size: jax.Array
  width: int = flax.struct.field(pytree_node=False)  # N: the windows' length, the longest match searched

  @staticmethod
  def of(tokens_Pl: jax.Array, width: int) -> Pool:
    """The pool of `tokens_Pl` with its index over windows of `width` tokens (see the module docstring)."""
    return _build(jnp.asarray(tokens_Pl, jnp.int32), width)

  @property
  def capacity(self) -> int:
    return self.tokens.shape[0]

  def appended(self, prompts_BxP, prompt_lengths_B, tokens_BxO, counts_B) -> Pool:
    """This pool with a call's sequences appended (`appended`) and indexed again."""
    return Pool.of(appended(self.tokens, prompts_BxP, prompt_lengths_B, tokens_BxO, counts_B), self.width)

  def search(self, suffix_BxMt: jax.Array, occurrences: int) -> tuple[jax.Array, jax.Array]:
    """Each row's longest match of its reversed suffix `suffix_BxMt` ([B, Mt]; -2 past the context's start)
    among the indexed windows, and its latest occurrences: (n [B] int32, 0 = none; ends [B, Oc] int32 pool
    positions, latest first, -1 where fewer exist), M = `occurrences`; what a pass over the pool finds."""
    order_Pl = self.latest[0]
    window = lambda i_B: windows(self.tokens, order_Pl[i_B], self.width)
    insert_B = self._first(window, suffix_BxMt, self.width, strict=False)
    common = lambda i_B: jnp.where((i_B >= 0) & (i_B < self.size), _common_prefix(window(i_B), suffix_BxMt), 0)
    match_B = jnp.maximum(common(insert_B - 1), common(insert_B))
    begin_B = self._first(window, suffix_BxMt, match_B, strict=False)
    end_B = self._first(window, suffix_BxMt, match_B, strict=True)
    ends_BxOc = self._latest_in(jnp.where(match_B > 0, begin_B, 0), jnp.where(match_B > 0, end_B, 0), occurrences)
    return match_B.astype(jnp.int32), ends_BxOc

  def _first(self, window, suffix_BxMt: jax.Array, prefix, strict: bool) -> jax.Array:
    """Per row, the first entry whose window's first `prefix` tokens compare >= (or > when `strict`)
    the suffix's: a binary search over [0, size)."""
    prefix_B = jnp.broadcast_to(prefix, suffix_BxMt.shape[:1])

    def halve(_, bounds):
      low_B, high_B = bounds
      middle_B = (low_B + high_B) // 2
      sign_B = _compare(window(middle_B), suffix_BxMt, prefix_B)
      below_B = (sign_B <= 0) if strict else (sign_B < 0)
      open_B = low_B < high_B
      return (jnp.where(open_B & below_B, middle_B + 1, low_B), jnp.where(open_B & ~below_B, middle_B, high_B))

    steps = max(self.latest.shape[1], 1).bit_length()
    low_B = jnp.zeros(suffix_BxMt.shape[:1], jnp.int32)
    return jax.lax.fori_loop(0, steps, halve, (low_B, jnp.broadcast_to(self.size, low_B.shape)))[0]

  def _latest_in(self, begin_B: jax.Array, end_B: jax.Array, occurrences: int) -> jax.Array:
    """The M latest positions among order[begin:end] per row ([B, Oc], latest first, -1 padded): the
    first min(M, 2^l) entries of the range's canonical blocks at each level l, then the M largest."""
    levels, padded = self.latest.shape
    candidates = []
    low_B, high_B = begin_B, end_B  # block indices at the level: the range left to cover
    for level in range(levels):
      block = 1 << level
      left_B = ((low_B & 1) == 1) & (low_B < high_B)
      right_B = ((high_B & 1) == 1) & (low_B + left_B < high_B)
      for used_B, index_B in ((left_B, low_B), (right_B, high_B - 1)):
        first_B = jnp.clip(index_B, 0, padded // block - 1) * block
        slots_BxC = first_B[:, None] + jnp.arange(min(occurrences, block))[None, :]
        candidates.append(jnp.where(used_B[:, None], self.latest[level][slots_BxC], -1))
      low_B, high_B = (low_B + left_B) >> 1, (high_B - right_B) >> 1
    everything_BxC = jnp.concatenate(candidates, axis=1)
    return jax.lax.top_k(everything_BxC, min(occurrences, everything_BxC.shape[1]))[0]


def _compare(window_BxMt: jax.Array, suffix_BxMt: jax.Array, prefix_B: jax.Array) -> jax.Array:
  """-1, 0 or 1 per row: the window's first `prefix_B` tokens against the suffix's, lexicographically."""
  differs_BxMt = (window_BxMt != suffix_BxMt) & (jnp.arange(suffix_BxMt.shape[1])[None, :] < prefix_B[:, None])
  first_B = jnp.argmax(differs_BxMt, axis=1)
  pick = lambda a: jnp.take_along_axis(a, first_B[:, None], axis=1)[:, 0]
  return jnp.where(jnp.any(differs_BxMt, axis=1), jnp.sign(pick(window_BxMt) - pick(suffix_BxMt)), 0)


def _common_prefix(window_BxMt: jax.Array, suffix_BxMt: jax.Array) -> jax.Array:
  """How many leading tokens the window and the suffix share ([B] int32)."""
  return jnp.sum(jnp.cumprod(window_BxMt == suffix_BxMt, axis=1), axis=1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=1)
def _build(tokens_Pl: jax.Array, width: int) -> Pool:
  size = tokens_Pl.shape[0]
  padded = 1 << max(size - 1, 0).bit_length()
  position_Pl = jnp.arange(size, dtype=jnp.int32)
  following_Pl = jnp.concatenate([tokens_Pl[1:], jnp.full((1,), CUT, tokens_Pl.dtype)])
  indexed_Pl = (tokens_Pl >= 0) & (following_Pl >= 0)
  window_PlxMt = windows(tokens_Pl, position_Pl, width)
  keys = ((~indexed_Pl).astype(jnp.int32),) + tuple(window_PlxMt.T)
  order_Pl = jax.lax.sort(keys + (position_Pl,), num_keys=len(keys))[-1]
  order_Pl = jnp.where(jnp.arange(size) < jnp.sum(indexed_Pl), order_Pl, -1)
  levels = [jnp.pad(order_Pl, (0, padded - size), constant_values=-1)]
  for level in range(1, padded.bit_length()):
    levels.append(-jnp.sort(-levels[0].reshape(-1, 1 << level), axis=1).reshape(-1))
  return Pool(tokens=tokens_Pl, latest=jnp.stack(levels), size=jnp.sum(indexed_Pl).astype(jnp.int32), width=width)
