"""Logits -> processed probabilities (temperature, top-k, top-p) -> tokens. The one place for it.

Speculative decoding is exact only if the acceptance ratio q(x)/p(x) uses the very distributions the
tokens were drawn from, so every sampled generate loop calls `probabilities` and then `sample` on its
output. Greedy decoding (temperature 0) needs no distribution: its programs take `greedy_tokens`, the
argmax of the float32 logits, and compare token ids.

Which program runs is static: `sampling_params` sets the flags `greedy`, `use_top_k` and `use_top_p`
on the host, so switching greedy <-> sampled or turning top-k / top-p on or off recompiles, while the
knobs themselves (temperature, k, p) are runtime arrays: changing them within a mode does not. The
knobs may differ per batch row (each request's own, `Knobs`): the flags then cover every row (greedy
only when every row is; a filter on when any row uses it), a greedy row of a sampled program gets the
one-hot argmax and a row with a filter off gets exactly the unfiltered distribution, so one program
serves every mix of values within its mode.

Top-k and top-p look only at the `candidates` largest logits of each row (`jax.lax.top_k`, a partial
sort) instead of sorting the whole vocabulary: the k-th largest logit is among them whenever
k <= candidates, which `sampling_params` ensures by raising `candidates` to k, and the nucleus is
among them whenever they hold at least top_p of the mass; a row where they do not (a flat distribution)
makes the call fall back to an exact search of the nucleus' edge over the whole vocabulary, so the
result is always that of a full sort. Nothing here gathers a vocabulary that a device mesh splits
(`_top_candidates`, `_nucleus_threshold_by_search`): sampling runs on vocabulary-sharded logits.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from specjax.constraints.mask import Unconstrained

CANDIDATES = 256  # default static bound on the tokens top-k / top-p examine without a full sort


class Knobs(NamedTuple):
  """One row's sampling values: a request's own, else the call's (runtime values of a compiled program)."""

  temperature: float = 0.0  # 0 = greedy (the argmax)
  top_k: int = 0  # keep the k most likely tokens; 0 disables
  top_p: float = 1.0  # keep the smallest set of mass >= top_p (nucleus); 1 disables


# What each knob must be: (the test, the rule an error states).
_RULES = {
    "temperature": (lambda t: t >= 0.0, ">= 0 (0 = greedy)"),
    "top_k": (lambda k: int(k) == k and k >= 0, "an integer >= 0 (0 disables it)"),
    "top_p": (lambda p: 0.0 < p <= 1.0, "in (0, 1] (1 disables it)")
}


def knob_error(name: str, value: Any) -> str:
  """Why `value` cannot be the knob `name` of `Knobs` ("must be ..., got ..."); "" when it can. The one
  check of a knob: `sampling_params` raises it naming the knob, a request naming itself too."""
  valid, rule = _RULES[name]
  if isinstance(value, numbers.Real) and not isinstance(value, bool) and valid(value):
    return ""
  return f"must be {rule}, got {value!r}"


@flax.struct.dataclass
class SamplingParams:
  """Made by `sampling_params`, which derives the static fields from the values."""

  temperature: jax.Array  # [] (every row's) or [B] float32; 0 means greedy (the argmax)
  top_k: jax.Array  # [] or [B] int32; keep the k most likely tokens, 0 disables
  top_p: jax.Array  # [] or [B] float32; keep the smallest set of mass >= top_p (nucleus), 1 disables
  greedy: bool = flax.struct.field(pytree_node=False)  # every temperature <= 0
  use_top_k: bool = flax.struct.field(pytree_node=False)  # some top_k > 0
  use_top_p: bool = flax.struct.field(pytree_node=False)  # some top_p < 1
  candidates: int = flax.struct.field(pytree_node=False)  # static bound, >= every top_k
  # Which tokens may come next (`constraints.mask`), applied to the logits before everything else, so
  # that target and draft are restricted alike; its arrays (a token table and each row's state) are runtime
  # values, whether there is one is static (the null `Unconstrained` has no arrays).
  constraint: Any = Unconstrained()

  def after(self, tokens_BxT: jax.Array, counts_B: jax.Array | int) -> SamplingParams:
    """These params with the constraint's state advanced by each row's first `counts_B` tokens."""
    return self.replace(constraint=self.constraint.after(tokens_BxT, counts_B))

  def covering(self, knobs: Sequence[Knobs]) -> SamplingParams:
    """These params with the static flags of a program that serves rows sampling with `knobs` (each
    request's own, else the call's: these params' values stay, for a row that brings none)."""
    rows = sampling_params(*zip(*knobs))
    return self.replace(greedy=rows.greedy, use_top_k=rows.use_top_k, use_top_p=rows.use_top_p,
                        candidates=max(self.candidates, rows.candidates))

  def for_rows(self, knobs_B: Sequence[Knobs]) -> SamplingParams:
    """This program (these static flags) with row b sampling with `knobs_B[b]` (runtime arrays [B]); a
    row this program cannot serve (one made by `covering` them all can) is a ValueError."""
    rows = sampling_params(*zip(*knobs_B), candidates=self.candidates)
    if ((self.greedy and not rows.greedy) or rows.use_top_k > self.use_top_k or rows.use_top_p > self.use_top_p or
        rows.candidates > self.candidates):
      raise ValueError(f"rows sampling with {list(knobs_B)} need another program than this one")
    return self.replace(temperature=rows.temperature, top_k=rows.top_k, top_p=rows.top_p)


def sampling_params(temperature: float | Sequence[float] = 0.0, top_k: int | Sequence[int] = 0,
                    top_p: float | Sequence[float] = 1.0, candidates: int = CANDIDATES) -> SamplingParams:
  """Validated `SamplingParams` from Python numbers, each knob one number for every row or a sequence
  of one per batch row [B]; bad values fail here, not inside XLA.

  The static flags follow from the values of every row: greedy only when every row is, top-k / top-p
  on when any row uses it, and `candidates` (raised to the largest top_k) select the compiled program."""
  values = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
  for name, value in values.items():
    per_row = np.ndim(value) > 0
    for row, one in enumerate(list(value) if per_row else [value]):
      error = knob_error(name, one)
      if error:
        raise ValueError(f"{name}{f'[{row}]' if per_row else ''} {error}")
  if int(candidates) != candidates or candidates < 1:
    raise ValueError(f"candidates must be an integer >= 1, got {candidates}")
  temperature, top_k, top_p = (np.asarray(values[name], dtype)
                               for name, dtype in (("temperature", np.float32), ("top_k", np.int32), ("top_p",
                                                                                                      np.float32)))
  return SamplingParams(temperature=jnp.asarray(temperature), top_k=jnp.asarray(top_k), top_p=jnp.asarray(top_p),
                        greedy=bool(np.all(temperature <= 0.0)), use_top_k=bool(np.any(top_k > 0)),
                        use_top_p=bool(np.any(top_p < 1.0)), candidates=max(int(candidates), int(np.max(top_k))))


def argmax_tokens(logits_xV: jax.Array, params: SamplingParams) -> jax.Array:
  """Tokens [...] int32: the greedy choice, the argmax of the logits the params' constraint allows."""
  return greedy_tokens(params.constraint.mask(logits_xV))


def greedy_tokens(logits_xV: jax.Array) -> jax.Array:
  """Tokens [...] int32: the argmax of the float32 logits (the first of tied maxima, or the first
  NaN, as `jnp.argmax`).

  Taken as the smallest index holding the maximum: two plain reductions, which XLA's CPU backend
  vectorizes, where `jnp.argmax` is a variadic (value, index) reduction that it runs several times
  slower over a vocabulary of 150k logits."""
  logits_xV = logits_xV.astype(jnp.float32)
  vocab = logits_xV.shape[-1]
  at_max_xV = (logits_xV == jnp.max(logits_xV, axis=-1, keepdims=True)) | jnp.isnan(logits_xV)
  return jnp.min(jnp.where(at_max_xV, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)


def _nucleus_threshold(sorted_ZxC: jax.Array, p_Zx1: jax.Array) -> tuple[jax.Array, jax.Array]:
  """From each row's probabilities in descending order (all, or a prefix) and its top_p (or one for all):
  the smallest probability kept by top-p [Z, 1] (the first token is always kept, the mass before it being
  0; each next one while the mass before it is < p) and whether the prefix holds the nucleus [Z, 1] (its
  mass is >= p: no later token can be kept)."""
  mass_ZxC = jnp.cumsum(sorted_ZxC, axis=-1)
  kept_ZxC = mass_ZxC - sorted_ZxC < p_Zx1
  return (jnp.min(jnp.where(kept_ZxC, sorted_ZxC, jnp.inf), axis=-1, keepdims=True), mass_ZxC[:, -1:] >= p_Zx1)


def _nucleus_threshold_by_search(probs_ZxV: jax.Array, p_Zx1: jax.Array) -> jax.Array:
  """The threshold of `_nucleus_threshold` over the whole vocabulary [Z, 1], without sorting it.

  It is the largest t with mass(probs >= t) >= p: the mass of the tokens above the smallest kept one
  is < p, and with it >= p. Non-negative float32 values order like their bit patterns, so a
  bisection over the 2^31 patterns finds t exactly in 31 masked sums over V (reductions, which a
  mesh splitting the vocabulary computes shard by shard; a sort would gather it)."""
  def mass_at_least(bits_Zx1):
    threshold_Zx1 = jax.lax.bitcast_convert_type(bits_Zx1, jnp.float32)
    return jnp.sum(jnp.where(probs_ZxV >= threshold_Zx1, probs_ZxV, 0.0), axis=-1, keepdims=True) >= p_Zx1

  def halve(_, bounds):
    low_Zx1, high_Zx1 = bounds  # mass_at_least(low) holds, mass_at_least(high) does not
    middle_Zx1 = low_Zx1 + (high_Zx1 - low_Zx1) // 2
    holds_Zx1 = mass_at_least(middle_Zx1)
    return jnp.where(holds_Zx1, middle_Zx1, low_Zx1), jnp.where(holds_Zx1, high_Zx1, middle_Zx1)

  high_Zx1 = jax.lax.bitcast_convert_type(jnp.max(probs_ZxV, axis=-1, keepdims=True), jnp.int32) + 1
  low_Zx1, _ = jax.lax.fori_loop(0, 31, halve, (jnp.zeros_like(high_Zx1), high_Zx1))
  return jax.lax.bitcast_convert_type(low_Zx1, jnp.float32)


def _top_candidates(scores_ZxV: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
  """`jax.lax.top_k(scores_ZxV, count)`, without gathering the vocabulary when a mesh splits it.

  Under a mesh (`jax.set_mesh`) each device takes the `count` best of its own rows and vocabulary
  shard (a `shard_map` of a local top_k: XLA does not partition top_k, it would gather the whole
  [Z, V] first), then the Sh x count survivors of the Sh vocabulary shards compete (the global best
  `count` are among them). Without a mesh it is the plain top_k."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return jax.lax.top_k(scores_ZxV, count)
  Z, V = scores_ZxV.shape
  rows = "data" if Z % mesh.shape["data"] == 0 else None
  shards = mesh.shape["model"] if V % mesh.shape["model"] == 0 else 1
  vocab = "model" if shards > 1 else None
  per_shard = V // shards

  def local_top(block_zxVs):
    values_zxC, index_zxC = jax.lax.top_k(block_zxVs, min(count, per_shard))
    return values_zxC, index_zxC + (jax.lax.axis_index("model") * per_shard if vocab else 0)

  spec = PartitionSpec(rows, vocab)
  values_ZxShC, index_ZxShC = jax.shard_map(local_top, in_specs=spec, out_specs=(spec, spec))(scores_ZxV)
  if shards == 1:
    return values_ZxShC, index_ZxShC
  top_ZxC, survivor_ZxC = jax.lax.top_k(values_ZxShC, count)
  return top_ZxC, jnp.take_along_axis(index_ZxShC, survivor_ZxC, axis=-1)


def _per_row(knob: jax.Array, leading: tuple[int, ...]) -> jax.Array:
  """A knob, [] (every row's) or [B] (a batch row's), as [Z, 1]: one per row of logits whose leading
  shape `leading` = (B, ...) is flattened to Z rows."""
  return jnp.broadcast_to(knob.reshape(knob.shape + (1,) * (len(leading) - knob.ndim)), leading).reshape(-1, 1)


def probabilities(logits_xV: jax.Array, params: SamplingParams) -> jax.Array:
  """Float32 probabilities [..., V] after the constraint's mask (its state's shape is the logits' leading
  shape), then temperature, then top-k, then top-p (the HF order); knobs of shape [B] are batch rows' (the
  logits' first axis).

  Ties: top-k keeps every token whose logit equals the k-th largest, top-p every token whose
  probability equals the smallest kept one. Greedy params give the one-hot argmax (the definition;
  greedy loops use `greedy_tokens` and never build it), and so does a greedy row of sampled params."""
  vocab, leading = logits_xV.shape[-1], logits_xV.shape[:-1]
  logits_ZxV = params.constraint.mask(logits_xV.astype(jnp.float32)).reshape(-1, vocab)
  argmax_ZxV = jax.nn.one_hot(greedy_tokens(logits_ZxV), vocab, dtype=jnp.float32)
  if params.greedy:
    return argmax_ZxV.reshape(logits_xV.shape)
  temperature_Zx1 = _per_row(params.temperature, leading)
  greedy_Zx1 = temperature_Zx1 <= 0.0
  scaled_ZxV = logits_ZxV / jnp.where(greedy_Zx1, 1.0, temperature_Zx1)  # a greedy row's is replaced below
  if params.use_top_k or params.use_top_p:
    top_ZxC, index_ZxC = _top_candidates(scaled_ZxV, min(params.candidates, vocab))
  if params.use_top_k:  # k <= candidates: the k-th largest is a candidate (k >= V keeps everything; 0 all)
    k_Zx1 = _per_row(params.top_k, leading)
    kth_Zx1 = jnp.take_along_axis(top_ZxC, jnp.maximum(jnp.minimum(k_Zx1, vocab) - 1, 0), axis=-1)
    scaled_ZxV = jnp.where((k_Zx1 == 0) | (scaled_ZxV >= kth_Zx1), scaled_ZxV, -jnp.inf)
  probs_ZxV = jax.nn.softmax(scaled_ZxV, axis=-1)
  if params.use_top_p:
    probs_ZxV = _nucleus(probs_ZxV, scaled_ZxV, index_ZxC, _per_row(params.top_p, leading), greedy_Zx1)
  return jnp.where(greedy_Zx1, argmax_ZxV, probs_ZxV).reshape(logits_xV.shape)


def _nucleus(probs_ZxV: jax.Array, scaled_ZxV: jax.Array, index_ZxC: jax.Array, p_Zx1: jax.Array,
             greedy_Zx1: jax.Array) -> jax.Array:
  """Top-p of each row's probabilities [Z, V] (from the scaled logits [Z, V]; `index_ZxC`: their
  candidates), a row of p = 1 left exactly as it is. The candidates' probabilities in descending order
  (softmax is monotonic) hold the nucleus when they hold at least p of the mass; else (rarely: a flat
  distribution) the edge is searched over the whole vocabulary, in a cond so that it runs only then
  (never for a row it leaves alone or a greedy row, whose probabilities are replaced)."""
  off_Zx1 = p_Zx1 >= 1.0
  threshold_Zx1, holds_Zx1 = _nucleus_threshold(jnp.take_along_axis(probs_ZxV, index_ZxC, axis=-1), p_Zx1)
  threshold_Zx1 = jax.lax.cond(jnp.all(holds_Zx1 | off_Zx1 | greedy_Zx1), lambda: threshold_Zx1,
                               lambda: _nucleus_threshold_by_search(probs_ZxV, p_Zx1))
  nucleus_ZxV = jax.nn.softmax(jnp.where(probs_ZxV >= threshold_Zx1, scaled_ZxV, -jnp.inf), axis=-1)
  return jnp.where(off_Zx1, probs_ZxV, nucleus_ZxV)


def sample(key: jax.Array, probs_xV: jax.Array) -> jax.Array:
  """Tokens [...] int32 drawn from float32 probabilities [..., V] (a point mass gives its token
  exactly: every other entry has log-probability -inf)."""
  return jax.random.categorical(key, jnp.log(probs_xV), axis=-1).astype(jnp.int32)


def tokens_and_probabilities(key: jax.Array, logits_xV: jax.Array,
                             params: SamplingParams) -> tuple[jax.Array, jax.Array | None]:
  """Tokens [...] int32 after logits [..., V] and the float32 distribution [..., V] they were drawn
  from; when greedy, the argmax and None (a point mass: no distribution is built)."""
  if params.greedy:
    return argmax_tokens(logits_xV, params), None
  probs_xV = probabilities(logits_xV, params)
  return sample(key, probs_xV), probs_xV


def next_tokens(key: jax.Array, logits_xV: jax.Array, params: SamplingParams) -> jax.Array:
  """Tokens [...] int32 after logits [..., V]: the argmax when greedy, else a draw from
  `probabilities` (how the autoregressive loop and every first token are chosen)."""
  return tokens_and_probabilities(key, logits_xV, params)[0]
