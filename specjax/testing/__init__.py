"""A drafter of your own checked as specjax checks its own, in a few lines (as gemma ships `gm.testing`):

    from specjax import testing
    target = testing.tiny_model(seed=0, vocab=8, n_layers=2, scale=0.5)
    testing.check_greedy(MyDrafter(...), target)   # greedy output is the target's own, token for token
    testing.check_sampled(MyDrafter(...), target)  # sampled first tokens follow the target's exact law

- `tiny_model`, `perturbed`: tiny random models (numpy weights, nothing to download or compile) and a
  draft that agrees with one often but not always.
- `run`: one call of the jitted speculative loop for any drafter; `target_greedy`: the target's own
  greedy decoding (the autoregressive program) to compare with.
- `request`, `speculate`: the loop called as any caller calls it, its parts the library's own objects
  (the settings a `SpeculativeLoop`, a `generation.Request` of lists of ids, the policy's `Tables`), with
  fresh caches of one given size (tests that share a compiled program share its shapes).
- `exact_distribution`: the joint law of a tiny-vocabulary model's first generated tokens, enumerated
  (logits from the library's forward, probabilities from `reference`, a float64 numpy implementation
  of temperature / top-k / top-p that shares no code with `specjax.sampling`); `chi_square_pvalue`.
- `check_greedy`, `check_sampled`: the greedy and the chi-square exactness checks of the test suite.

A statistical check at level `level` fails a correct drafter with probability `level` per call (fixed
seeds make each call's outcome deterministic); a drafter that breaks exactness (a wrong reported
distribution, a peek at the target) fails it with probability near one at the default 5,000 rows.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from specjax import autoregressive
from specjax.generation import Request, as_token_lists, pad_prompts
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import forward, init_params
from specjax.sampling import SamplingParams, sampling_params
from specjax.speculative.drafters.base import Drafter
from specjax.speculative.k_policy import Tables
from specjax.speculative.loop import SpeculativeLoop, speculative_generate
from specjax.testing import reference

Model = tuple[ModelConfig, Any]  # (config, params)
GREEDY, T1 = sampling_params(0.0), sampling_params(1.0)
NO_EOS = (-1,)  # an id no model emits: rows stop on their budgets only
PROMPTS = ((5, 1, 3, 4, 2), (1, 2), (6, 1, 2, 3, 4, 5, 6, 7))  # ids < 8: valid for any vocabulary of 8 or more


def tiny_model(seed: int, vocab: int = 61, arch: str = "llama", d_model: int = 32, n_layers: int = 1,
               scale: float = 0.3) -> Model:
  """A tiny random model, weights drawn with numpy (no compile) in the tree `init_params` defines;
  std `scale` on matrices makes the distributions peaked and free of near-ties."""
  config = ModelConfig(arch=arch, vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=4,
                       n_kv_heads=4 if arch == "gpt2" else 2, head_dim=d_model // 4, d_ff=2 * d_model,
                       max_positions=64 if arch == "gpt2" else 0)
  rng = np.random.default_rng(seed)
  init = lambda path, leaf: jnp.asarray(
      rng.normal(0.0, scale, leaf.shape)
      if leaf.ndim == 2 else np.full(leaf.shape, 1.0 if path[-1].key == "scale" else 0.0), jnp.float32)
  shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  return config, jax.tree_util.tree_map_with_path(init, shapes)


def perturbed(model: Model, noise: float, seed: int) -> Model:
  """The same architecture with Gaussian noise of std `noise` on every weight: a draft that agrees
  with the model often but not always."""
  config, params = model
  rng = np.random.default_rng(seed)
  return config, jax.tree.map(lambda w: w + jnp.asarray(rng.normal(0.0, noise, w.shape), jnp.float32), params)


def request(prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], sampling: SamplingParams = GREEDY, *,
            seed: int = 0, eos_ids: Sequence[int] = NO_EOS, round_limit: int | None = None) -> Request:
  """`prompts` (lists of ids) as the `generation.Request` both loops take: right-padded (`pad_prompts`),
  `max_new_tokens` an int or one per row, the key `jax.random.key(seed)`, EOS off unless `eos_ids` says
  (rows stop on their budgets), `round_limit` rounds at most (None: no limit)."""
  padded_BxP, lengths_B = pad_prompts(prompts)
  return Request(padded_BxP, lengths_B, max_new_tokens, list(eos_ids), sampling, jax.random.key(seed), round_limit)


def speculate(loop: SpeculativeLoop, target_params: Any, drafter: Drafter, request: Request, *, cache_len: int,
              tables: Tables = Tables(), lower: bool | str = False):
  """`speculative_generate` with a fresh target cache and drafter storage (`drafter.storage`) of `cache_len`
  positions for the request's rows: the loop's settings, the request and the policy's tables stay the
  library's own objects, so a test reads as any caller's code. Returns the loop's output (`lower`: the
  lowered program)."""
  batch = np.shape(request.prompts_BxP)[0]
  return speculative_generate(loop, target_params, drafter, request, init_cache(loop.target_config, batch, cache_len),
                              drafter.storage(batch, cache_len), tables, lower)


def run(drafter: Drafter, target: Model, prompts: Sequence[Sequence[int]] = PROMPTS, *, k: int = 3,
        max_new_tokens: int = 12, sampling: SamplingParams = GREEDY, seed: int = 0, cache_len: int | None = None):
  """`drafter` decoding `prompts` (lists of ids) against `target` in one call of the jitted loop, K = `k`
  (a tree drafter: its tree's depth), the fixed policy, EOS off: the loop's output (`tokens` [B, W],
  `counts` [B], `acceptance`). Caches of `cache_len` positions (default: the longest prompt, the budget
  and a chain's look-ahead; a tree of N nodes needs N - 1 past the budget)."""
  config, params = target
  asked = request(prompts, max_new_tokens, sampling, seed=seed)
  cache_len = cache_len or asked.prompts_BxP.shape[1] + max_new_tokens + 1 + k + 1  # + K + 1: the look-ahead
  return speculate(SpeculativeLoop(config, k, max_new_tokens), params, drafter, asked, cache_len=cache_len)


def target_greedy(target: Model, prompts: Sequence[Sequence[int]] = PROMPTS, max_new_tokens: int = 12, *,
                  cache_len: int | None = None) -> list[list[int]]:
  """`target`'s own greedy decoding of `prompts` (the autoregressive program), as token lists; a cache of
  `cache_len` positions (default: the longest prompt and the budget)."""
  config, params = target
  asked = request(prompts, max_new_tokens)
  cache = init_cache(config, len(prompts), cache_len or asked.prompts_BxP.shape[1] + max_new_tokens + 1)
  out = autoregressive.generate(config, params, asked, cache, out_width=max_new_tokens)
  return as_token_lists(out.tokens, out.counts)


def check_greedy(drafter: Drafter, target: Model, prompts: Sequence[Sequence[int]] = PROMPTS, *, k: int = 3,
                 max_new_tokens: int = 12, cache_len: int | None = None):
  """Asserts that greedy speculative decoding with `drafter` gives the target's own greedy tokens, row
  for row (prompts of several lengths, budgets not multiples of K + 1), both with caches of `cache_len`
  positions (None: `run`'s and `target_greedy`'s defaults); returns the loop's output."""
  out = run(drafter, target, prompts, k=k, max_new_tokens=max_new_tokens, cache_len=cache_len)
  got = as_token_lists(out.tokens, out.counts)
  want = target_greedy(target, prompts, max_new_tokens, cache_len=cache_len)
  for row, (tokens, expected) in enumerate(zip(got, want)):
    assert tokens == expected, f"row {row}: speculative {tokens} != the target's greedy {expected}"
  return out


def exact_distribution(config: ModelConfig, params: Any, prompt: Sequence[int], sampling: SamplingParams,
                       steps: int) -> np.ndarray:
  """P(first `steps` generated tokens after `prompt`) as a [V] * steps float64 array, every continuation
  enumerated (V^(steps-1) prefixes in one forward: a tiny vocabulary only)."""
  vocab = config.vocab_size
  prefixes = np.array(list(itertools.product(range(vocab), repeat=steps - 1)), np.int32)
  tokens = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1)
  logits, _ = jax.jit(forward, static_argnums=0)(config, params, jnp.asarray(tokens),
                                                 init_cache(config, len(tokens), tokens.shape[1]))
  probs = reference.params_probabilities(np.asarray(logits[:, len(prompt) - 1:]), sampling)  # [V^(s-1), s, V]
  joint = np.ones(())
  for step in range(steps):
    table = probs[:, step].reshape([vocab] * steps)  # [prefix token 1 .. s-1, next token]
    joint = joint[..., None] * table[(slice(None),) * step + (0,) * (steps - 1 - step)]  # on the first `step` only
  return joint


def chi_square_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
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
  return float(stats.chisquare(observed, expected).pvalue)


def check_sampled(drafter: Drafter, target: Model, prompt: Sequence[int] = (3, 1, 4), *, k: int = 2, rows: int = 5_000,
                  steps: int = 3, sampling: SamplingParams = T1, level: float = 1e-3) -> float:
  """Asserts at level `level` (chi-square) that the first `steps` tokens of `rows` seeded rows decoded
  from `prompt` with `drafter` follow the target's exact joint law of them (`exact_distribution`): with
  K = `k` >= steps - 1 the first round's draft positions and its bonus are all tested. The rows' keys
  derive from one fixed seed. Returns the p-value. The target's vocabulary must be tiny (V^steps cells)."""
  config = target[0]
  if config.vocab_size**steps > 1_000_000:
    raise ValueError(f"check_sampled enumerates V^steps = {config.vocab_size}^{steps} sequences: use a "
                     f"vocabulary of a few ids (tiny_model(vocab=8)) or fewer steps")
  out = run(drafter, target, [list(prompt)] * rows, k=k, max_new_tokens=steps, sampling=sampling)
  index = np.ravel_multi_index(np.asarray(out.tokens)[:, :steps].T, [config.vocab_size] * steps)
  observed = np.bincount(index, minlength=config.vocab_size**steps)
  pvalue = chi_square_pvalue(observed, exact_distribution(*target, prompt, sampling, steps).ravel())
  assert pvalue > level, f"the first {steps} tokens of {rows} rows do not follow the target (p = {pvalue:.3g})"
  return pvalue
