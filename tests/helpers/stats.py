"""Statistical tests the exactness checks share."""

import numpy as np
from scipy import stats


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
