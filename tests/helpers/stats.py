"""Statistical tests the exactness checks share."""

import numpy as np
from scipy import stats

from specjax.testing import chi_square_pvalue  # noqa: F401 (for the tests)

# Rows of one seeded engine call behind each chi-square test of the engine (unless a module states its
# own). At 10,000 rows the weakest injected faults (the EAGLE tree's children not renormalised, the bonus
# drawn from the residual against p_K) scored 252 on 43 and 275 on 55 degrees of freedom; a statistic's
# excess over its degrees of freedom scales with the rows, so at 5,000 they score about 150 and 165
# (p ~ 1e-13 and 1e-12), still far below their thresholds of 1e-6, and every in-suite mutant fails at
# this size (checked, as are the plugin's tree mutants: p underflows to 0). 5,000 rows shorten the
# execution-bound tests (the dynamic tree's from 30 to 22 s on 2 cores).
SAMPLE_ROWS = 5_000

# Equiprobable bins of the probability integral transform per position (`pit_pvalues`): with 10,000+
# rows, 10 bins expect 1,000+ draws each.
PIT_BINS = 10


def randomized_pit(tokens_ZxT, probs_ZxTxV, seed: int = 0):
  """The randomized probability integral transform of each generated token against the distribution
  it should follow given its row's earlier tokens: u = F(x - 1) + U * P(x), U uniform (numpy, fixed
  `seed`). For an exact sampler the u of all rows and positions are i.i.d. uniform on [0, 1] (each u is
  uniform given everything before it). Returns (u [Z, T], whether some token had probability 0)."""
  tokens_ZxT = np.asarray(tokens_ZxT)
  probs_ZxTxV = np.asarray(probs_ZxTxV, np.float64)
  p_ZxT = np.take_along_axis(probs_ZxTxV, tokens_ZxT[..., None], axis=2)[..., 0]
  below_ZxT = np.take_along_axis(np.cumsum(probs_ZxTxV, axis=2) - probs_ZxTxV, tokens_ZxT[..., None], axis=2)[..., 0]
  uniform_ZxT = np.random.default_rng(seed).uniform(size=tokens_ZxT.shape)
  return np.clip(below_ZxT + uniform_ZxT * p_ZxT, 0.0, 1.0), bool((p_ZxT <= 0).any())


def pit_pvalues(tokens_ZxT, probs_ZxTxV, seed: int = 0) -> np.ndarray:
  """[T] chi-square p-values, one per position, of the rows' `randomized_pit` values in PIT_BINS
  equiprobable bins against uniform (PIT_BINS - 1 degrees of freedom each; independent tests for an
  exact sampler). All 0 when some token had probability 0 (a draw outside the support)."""
  u_ZxT, impossible = randomized_pit(tokens_ZxT, probs_ZxTxV, seed)
  if impossible:
    return np.zeros(u_ZxT.shape[1])
  bins_ZxT = np.minimum((u_ZxT * PIT_BINS).astype(np.int64), PIT_BINS - 1)
  return np.array(
      [stats.chisquare(np.bincount(bins_ZxT[:, t], minlength=PIT_BINS)).pvalue for t in range(u_ZxT.shape[1])])
