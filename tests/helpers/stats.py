"""Statistical tests the exactness checks share."""

import numpy as np
from scipy import stats

# Rows of one seeded engine call behind each chi-square test of the engine (unless a module states its
# own). At 10,000 rows every injected fault of these tests is still rejected far below its threshold
# of 1e-6 or 1e-12: the weakest, the EAGLE tree's children not renormalised and the bonus drawn from
# the residual against p_K, score 252 on 43 and 275 on 55 degrees of freedom (p = 3e-31 and 4e-31).
# 30,000 rows tripled the run of each call (4.2 against 1.5 s on 2 cores with the tests' XLA flags).
SAMPLE_ROWS = 10_000


def chi_square_pvalue(observed, probs):
  """Chi-square goodness of fit of counts to `probs` on its support, cells expecting fewer than 5
  draws pooled; any draw outside the support gives p-value 0."""
  support = probs > 0
  if observed[~support].any():
    return 0.0
  observed, expected = observed[support], probs[support] / probs[support].sum() * observed.sum()
  small = expected < 5
  if small.any():
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
  return stats.chisquare(observed, expected).pvalue
