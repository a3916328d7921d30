"""An independent float64 numpy reference for `specjax.sampling.probabilities`: what
`specjax.testing.exact_distribution`, the end-to-end tests' exact reference, turns logits into
distributions with.

The semantics it implements (those `specjax.sampling` documents), per row of logits over V ids:
- temperature T = 0: the one-hot of the argmax (the first index of tied maxima);
- else the logits divided by T, then (HF order) top-k, then top-p:
- top-k, k > 0: keep every id whose scaled logit is >= the min(k, V)-th largest (ties with it are all
  kept, so more than k ids may survive), the others get probability 0;
- softmax over the kept ids;
- top-p, p < 1: in descending order of probability, an id is kept while the mass of the ids before it
  is < p (the first one always); then every id whose probability is >= the smallest kept one (ties
  with it are all kept), renormalised.
No JAX here: only the logits may come from the library (models are checked against `transformers`).
"""

from __future__ import annotations

import numpy as np

from specjax.sampling import SamplingParams


def probabilities(logits_xV: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
  """float64 probabilities [..., V] after temperature, top-k and top-p (see the module docstring)."""
  logits_ZxV = np.asarray(logits_xV, np.float64).reshape(-1, np.shape(logits_xV)[-1])
  vocab = logits_ZxV.shape[-1]
  if temperature <= 0.0:
    return np.eye(vocab)[np.argmax(logits_ZxV, axis=-1)].reshape(np.shape(logits_xV))
  scaled_ZxV = logits_ZxV / temperature
  if top_k > 0:
    kth_Zx1 = -np.sort(-scaled_ZxV, axis=-1)[:, min(top_k, vocab) - 1:min(top_k, vocab)]
    scaled_ZxV = np.where(scaled_ZxV >= kth_Zx1, scaled_ZxV, -np.inf)
  probs_ZxV = np.exp(scaled_ZxV - scaled_ZxV.max(axis=-1, keepdims=True))
  probs_ZxV /= probs_ZxV.sum(axis=-1, keepdims=True)
  if top_p < 1.0:
    sorted_ZxV = -np.sort(-probs_ZxV, axis=-1)
    mass_before_ZxV = np.cumsum(sorted_ZxV, axis=-1) - sorted_ZxV
    threshold_Zx1 = np.min(np.where(mass_before_ZxV < top_p, sorted_ZxV, np.inf), axis=-1, keepdims=True)
    probs_ZxV = np.where(probs_ZxV >= threshold_Zx1, probs_ZxV, 0.0)
    probs_ZxV /= probs_ZxV.sum(axis=-1, keepdims=True)
  return probs_ZxV.reshape(np.shape(logits_xV))


def params_probabilities(logits_xV: np.ndarray, params: SamplingParams) -> np.ndarray:
  """`probabilities` with the knobs of a `SamplingParams` (read as Python numbers)."""
  return probabilities(logits_xV, float(params.temperature),
                       int(params.top_k) if params.use_top_k else 0,
                       float(params.top_p) if params.use_top_p else 1.0)
