"""The autoregressive baseline: greedy output equals `transformers.generate`, rows are independent,
EOS and budgets stop each row on its own, and bad inputs fail early."""

import pytest
import torch

from specjax import autoregressive, testing
from specjax.generation import as_token_lists
from specjax.models.hf import load_hf_dir
from specjax.models.kv_cache import init_cache
from specjax.sampling import sampling_params
from tests.helpers.tiny_hf import save_hf_model

GREEDY = sampling_params(0.0)


@pytest.fixture(scope="module", params=["qwen2", "gpt2"])
def model(request, tmp_path_factory):
  directory = str(tmp_path_factory.mktemp(request.param))
  hf_model = save_hf_model(request.param, directory)
  config, params = load_hf_dir(directory)
  return hf_model, config, params


def _generate(config, params, prompts, max_new, eos_ids=(), sampling=GREEDY, seed=0, cache_len=64):
  request = testing.request(prompts, max_new, sampling, seed=seed, eos_ids=eos_ids)
  out = autoregressive.generate(config, params, request, init_cache(config, len(prompts), cache_len))
  return as_token_lists(out.tokens, out.counts)


def test_greedy_matches_transformers_generate(model):
  hf_model, config, params = model
  prompts = [[5, 17, 3, 44, 9], [1, 2], [60, 61, 62, 63, 64, 65, 66, 67, 68]]
  got = _generate(config, params, prompts, 32)
  for prompt, row in zip(prompts, got):
    with torch.no_grad():
      want = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                               pad_token_id=0)[0, len(prompt):].tolist()
    assert row == want


def test_eos_and_budget_stop_rows_independently(model):
  _, config, params = model
  prompts = [[5, 17, 3, 44, 9], [1, 2]]
  free = _generate(config, params, prompts, 20)
  eos = free[0][6]  # a token that row 0 emits at index 6
  stopped = _generate(config, params, prompts, [20, 7], eos_ids=[eos])
  assert stopped[0] == free[0][:free[0].index(eos) + 1]
  row1_cut = free[1].index(eos) + 1 if eos in free[1][:7] else 7
  assert stopped[1] == free[1][:row1_cut]


def test_sampling_is_seeded_and_differs_across_seeds(model):
  _, config, params = model
  hot = sampling_params(1.5)
  a = _generate(config, params, [[3, 4]] * 2, 16, sampling=hot, seed=1)
  b = _generate(config, params, [[3, 4]] * 2, 16, sampling=hot, seed=1)
  c = _generate(config, params, [[3, 4]] * 2, 16, sampling=hot, seed=2)
  assert a == b and a != c
  assert a[0] != a[1]  # rows draw from their own keys


def test_prompt_longer_than_cache_is_a_clear_error(model):
  _, config, params = model
  with pytest.raises(ValueError, match="exceed the cache size"):
    _generate(config, params, [list(range(40))], 30, cache_len=64)
  with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
    _generate(config, params, [[1]], 0)
  with pytest.raises(ValueError, match="empty"):
    _generate(config, params, [[]], 3)


@pytest.mark.parametrize("kwargs, message", [(dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                                             (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k")])
def test_bad_sampling_values(kwargs, message):
  with pytest.raises(ValueError, match=message):
    sampling_params(**kwargs)
