"""The levels drafter's test setup: a levels drafter over a tiny model (the middle: its int4 copy on XLA;
the inner level: prompt lookup), and the middle's distributions at every position of whole sequences,
from one full forward each (no cache, no inner rounds)."""

import jax
import numpy as np

from specjax.models import quantized
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import forward
from specjax.speculative.drafters.levels import LevelsDrafter
from specjax.speculative.drafters.ngram import NgramDrafter
from specjax.speculative.drafters.quantized import QuantizedDrafter
from specjax.testing import reference

_forward = jax.jit(forward, static_argnums=0)
WIDTH = 40  # the longest sequence `middle_distributions` scores


def levels_drafter(model, inner_k: int, weights: str = "int4", narrow_passes: bool = True) -> LevelsDrafter:
  """A levels drafter whose middle level is `model` in `weights` (XLA's matmul; "float": `model` itself;
  `narrow_passes` False: every inner pass has inner_k + 1 positions, one compiled pass) and inner level
  prompt lookup."""
  config, params = model
  config = config.replace(matmul="xla", narrow_passes=narrow_passes)
  middle = QuantizedDrafter(config, quantized.quantize_params(config, params, quantized.parse(weights)))
  return LevelsDrafter(middle, NgramDrafter(vocab_size=config.vocab_size), inner_k=inner_k)


def middle_distributions(drafter: LevelsDrafter, sequences, starts, steps: int, sampling) -> np.ndarray:
  """[B, steps, V] float64: the middle's processed distribution (`reference`) of the token following
  sequences[b][:starts[b] + i], i < steps, from one causal forward of each whole sequence (right-padded)."""
  config, params = drafter.middle.config, drafter.middle.params
  padded_BxT = np.zeros((len(sequences), WIDTH), np.int32)  # one width: one compiled forward
  for row, sequence in enumerate(sequences):
    padded_BxT[row, :len(sequence)] = sequence
  logits_BxTxV = np.asarray(_forward(config, params, padded_BxT, init_cache(config, *padded_BxT.shape))[0])
  index_BxS = np.asarray(list(starts))[:, None] - 1 + np.arange(steps)[None, :]
  return reference.params_probabilities(np.take_along_axis(logits_BxTxV, index_BxS[:, :, None], axis=1), sampling)
