"""Wall-clock cost of forward passes: the draft/target cost ratio c of the theory, and T-token costs.

`metrics.theoretical_speedup(alpha, K, c)` needs c, the time of one draft pass relative to one target
pass. It is measured, not derived from parameter counts, by timing jitted single-step forwards of each
model at a fixed cache offset (compilation excluded: the first call of each shape is a warm-up). The
benchmarks and sweeps in `experiments/` share these helpers so that every c is measured the same way.
"""

from __future__ import annotations

import functools
import time
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.models.config import ModelConfig
from specjax.models.kv_cache import init_cache
from specjax.models.load import LoadedModel
from specjax.models.transformer import forward_hidden
from specjax.speculative.draft_head import DraftHead, draft_logits


def forward_seconds(config: ModelConfig, params, tokens: Iterable[int], repeats: int,
                    batch_size: int = 1, cache_len: int = 256, offset: int = 100,
                    head: DraftHead | None = None) -> dict[int, float]:
  """Median seconds of one jitted forward of [batch_size, T] tokens, for each T in `tokens`, with
  `offset` positions already cached (each T and batch size compiles once, before the timed calls);
  through the restricted output `head` when one is given (a `draft_vocab` draft)."""

  @functools.partial(jax.jit, donate_argnames=("cache",))
  def step(params, head, tokens_BxT, cache):
    hidden_BxTxD, cache = forward_hidden(config, params, tokens_BxT, cache)
    return draft_logits(config, params, head, hidden_BxTxD).argmax(-1), cache

  seconds = {}
  for T in tokens:
    cache = init_cache(config, batch_size, cache_len).advance(jnp.full((batch_size,), offset))
    tokens_BxT = jnp.ones((batch_size, T), jnp.int32)
    out_BxT, cache = step(params, head, tokens_BxT, cache)  # compiles
    out_BxT.block_until_ready()
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      out_BxT, cache = step(params, head, tokens_BxT, cache)
      out_BxT.block_until_ready()
      times.append(time.perf_counter() - start)
    seconds[T] = float(np.median(times))
  return seconds


def cost_ratio(target: LoadedModel, draft: LoadedModel, batch_size: int, repeats: int,
               head: DraftHead | None = None) -> float:
  """c = (median seconds of a 1-token draft forward, through `head` if given) / (same for the target),
  at `batch_size` rows."""
  draft_s = forward_seconds(draft.config, draft.params, [1], repeats, batch_size, head=head)[1]
  target_s = forward_seconds(target.config, target.params, [1], repeats, batch_size)[1]
  return draft_s / target_s
