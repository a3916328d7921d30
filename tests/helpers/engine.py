"""Tiny random models and drafts for the engine tests, the runners that decode with them (speculative
and the target's own greedy), and the exact enumeration of a model's first generated tokens."""

import jax
import jax.numpy as jnp
import numpy as np

from specjax import autoregressive, testing
from specjax.generation import as_token_lists, pad_prompts
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import forward
from specjax.sampling import probabilities, sampling_params
from specjax.speculative.drafters.model import ModelDrafter
from specjax.speculative.k_policy import Tables
from specjax.speculative.loop import SpeculativeLoop, speculative_generate
from specjax.testing import exact_distribution, perturbed, reference, tiny_model  # noqa: F401 (for the tests)
from tests.helpers.stats import chi_square_pvalue

GREEDY = sampling_params(0.0)
VOCAB = 61
NO_EOS = [-1]  # an id no model emits: keeps the EOS array's shape (and the compiled program) fixed
PROMPTS = [[5, 17, 3, 44, 9], [1, 2], [60, 1, 2, 3, 4, 5, 6, 7, 8]]
BUDGETS = [13, 6, 20]  # 12, 5, 19 tokens after the prefill's: some fill their last block, some cut it
OUT_WIDTH = 24
CACHE_LEN = 40

TARGET = tiny_model(0)


def _drafts():
  config, params = TARGET
  rolled_head = dict(params, lm_head={"weight": jnp.roll(params["lm_head"]["weight"], 1, axis=0)})
  return {
      "same": TARGET,
      "never": (config, rolled_head),  # its argmax is the target's argmax + 1 (mod V)
      "perturbed": perturbed(TARGET, 0.01, seed=7),
      "independent": tiny_model(3)
  }  # same shapes as the target: all four share one compiled program


DRAFTS = _drafts()


def run_speculative(draft, prompts=PROMPTS, budgets=BUDGETS, eos_ids=NO_EOS, k=3, sampling=GREEDY, seed=0,
                    target_cache_len=CACHE_LEN, draft_cache_len=CACHE_LEN, draft_head=None, stop_threshold=0.0,
                    target=TARGET, max_lag=1, tables=Tables(), round_limit=None, **settings):
  """Speculative decoding of `prompts` by `target` with the model drafter `draft`; `settings` are the
  loop's (`SpeculativeLoop`: the K policy, the acceptance rules), `tables` the policy's."""
  (target_config, target_params), (draft_config, draft_params) = target, draft
  drafter = ModelDrafter(draft_config, draft_params, draft_head, stop_threshold=stop_threshold, max_lag=max_lag)
  request = testing.request(prompts, budgets, sampling, seed=seed, eos_ids=eos_ids, round_limit=round_limit)
  return speculative_generate(SpeculativeLoop(target_config, k, OUT_WIDTH, **settings), target_params, drafter, request,
                              init_cache(target_config, len(prompts), target_cache_len),
                              drafter.storage(len(prompts), draft_cache_len), tables)


def target_greedy(prompts=PROMPTS, budgets=BUDGETS, eos_ids=NO_EOS, target=TARGET):
  """`target`'s own greedy decoding of `prompts`, as token lists."""
  config, params = target
  out = autoregressive.generate(config, params, testing.request(prompts, budgets, eos_ids=eos_ids),
                                init_cache(config, len(prompts), CACHE_LEN), out_width=OUT_WIDTH)
  return as_token_lists(out.tokens, out.counts)


def first_tokens_pvalue(model, prompt, sampling, tokens_ZxT) -> float:
  """Chi-square p-value of the rows' first S generated tokens against `model`'s exact joint
  distribution of them (`exact_distribution`)."""
  config = model[0]
  steps = tokens_ZxT.shape[1]
  index = np.ravel_multi_index(np.asarray(tokens_ZxT).T, [config.vocab_size] * steps)
  observed = np.bincount(index, minlength=config.vocab_size**steps)
  return chi_square_pvalue(observed, exact_distribution(*model, prompt, sampling, steps).ravel())


_CONDITIONAL_ROWS, _CONDITIONAL_WIDTH = 5_000, 32  # one compiled forward per model: chunks of rows, right-padded
_forward = jax.jit(forward, static_argnums=0)


def target_conditionals(model, prompt, sampling, tokens_ZxT) -> np.ndarray:
  """[Z, T, V] float64: the distribution `model` gives each generated token t of each row given the
  prompt and the row's tokens before t (one teacher-forced forward of [prompt, tokens] per row, logits
  from the library's forward, probabilities from `reference`, as `exact_distribution`): what an exact
  sampler draws token t from, position by position (`stats.pit_pvalues`)."""
  config, params = model
  tokens_ZxT = np.asarray(tokens_ZxT, np.int32)
  rows, steps = tokens_ZxT.shape
  assert len(prompt) + steps <= _CONDITIONAL_WIDTH
  sequences_ZxW = np.zeros((rows, _CONDITIONAL_WIDTH), np.int32)  # causal: the padding is never seen
  sequences_ZxW[:, :len(prompt)] = prompt
  sequences_ZxW[:, len(prompt):len(prompt) + steps] = tokens_ZxT
  chunks = []
  for start in range(0, rows, _CONDITIONAL_ROWS):
    chunk = np.zeros((_CONDITIONAL_ROWS, _CONDITIONAL_WIDTH), np.int32)
    part = sequences_ZxW[start:start + _CONDITIONAL_ROWS]
    chunk[:len(part)] = part
    logits, _ = _forward(config, params, jnp.asarray(chunk), init_cache(config, _CONDITIONAL_ROWS, _CONDITIONAL_WIDTH))
    chunks.append(np.asarray(logits[:len(part), len(prompt) - 1:len(prompt) - 1 + steps]))
  return reference.params_probabilities(np.concatenate(chunks), sampling)


def accept_all(key, proposal, target_probs_BxK1xV):
  """A broken rule: keeps every draft token, so the output follows the draft, not the target."""
  k = proposal.k
  return (jnp.full(proposal.tokens.shape[:1], k,
                   jnp.int32), jax.random.categorical(key, jnp.log(target_probs_BxK1xV[:, k])).astype(jnp.int32))


def accept_all_proposed(key, proposal, target_probs_BxK1xV):
  """A broken rule: keeps every proposed token (a point mass accepted without the target's probability),
  then draws from q after the last one."""
  next_probs_BxV = jnp.take_along_axis(target_probs_BxK1xV, proposal.lengths[:, None, None], axis=1)[:, 0]
  return proposal.lengths, jax.random.categorical(key, jnp.log(next_probs_BxV)).astype(jnp.int32)


SMALL_TARGET = tiny_model(10, vocab=8, n_layers=2, scale=0.5)
SMALL_DRAFT = perturbed(SMALL_TARGET, 0.05, seed=11)  # first-token acceptance about 0.7
SAMPLE_PROMPT, SAMPLE_STEPS = [3, 1, 4], 3

FORCED_DRAFT_PROMPTS = [[4, 8, 15], [16, 23], [42, 7, 9, 1]]


def forced_draft_rounds(cache_len: int, **fields):
  """A tiny model drafter (`fields`: its settings) initialised on FORCED_DRAFT_PROMPTS, its compiled
  `propose` and `commit`, and the draft's distributions at T = 1 of whole sequences [3, cache_len]: the
  kit of the tests that force each round's outcome and compare proposals with full forward passes."""
  config, params = tiny_model(5, d_model=16)
  drafter, batch = ModelDrafter(config, params, **fields), len(FORCED_DRAFT_PROMPTS)
  padded, lengths = pad_prompts(FORCED_DRAFT_PROMPTS)
  state = jax.jit(ModelDrafter.init)(drafter, drafter.storage(batch, cache_len), padded, lengths, None)
  score = jax.jit(lambda tokens_BxT: probabilities(
      forward(config, params, tokens_BxT, init_cache(config, batch, cache_len))[0], sampling_params(1.0)))
  return drafter, state, jax.jit(ModelDrafter.propose), jax.jit(ModelDrafter.commit), score
