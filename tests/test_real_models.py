"""Real checkpoints from the registry, loaded by specjax and by `transformers` (the reference).

Opt-in: run with SPECJAX_REAL_MODEL_TESTS=1; each test also skips unless its model is installed
(`python -m specjax.models fetch NAME`). The
transformers side loads the same GGUF (`from_pretrained(dir, gguf_file=...)`, 30-120 s on 2 cores);
both run in float32. Prints the max logit difference (run with `-s` to see it).
"""

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from specjax.models import registry
from specjax.models.kv_cache import init_cache
from specjax.models.load import load_model
from specjax.models.tokenizer import Tokenizer
from specjax.models.transformer import forward

CODE_PROMPT = "Write a Python function that returns the n-th Fibonacci number iteratively."
TEXTS = [
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "x  =  [ 1,  22,   333 ]  # naïve café 日本語 😀\r\n\tTrailing   ",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><|fim_prefix|><tool_call>"
]
NUM_NEW = 32


def installed_or_skip(name: str) -> str:
  if os.environ.get("SPECJAX_REAL_MODEL_TESTS") != "1":
    pytest.skip("real-model tests are opt-in: set SPECJAX_REAL_MODEL_TESTS=1")
  spec = registry.get_spec(name)
  if not registry.is_installed(spec):
    pytest.skip(f"{name} is not installed; run `{registry.fetch_command(name)}`")
  return registry.model_path(spec)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _step(config, params, tokens_BxT, cache):
  logits_BxTxV, cache = forward(config, params, tokens_BxT, cache)
  return logits_BxTxV, cache.advance(jnp.full((tokens_BxT.shape[0],), tokens_BxT.shape[1]))


def specjax_greedy(config, params, prompt: list[int]) -> tuple[np.ndarray, list[int]]:
  """Prompt logits [T, V] and NUM_NEW greedy tokens through the KV cache (EOS not special)."""
  cache = init_cache(config, 1, len(prompt) + NUM_NEW)
  logits, cache = _step(config, params, jnp.asarray([prompt], jnp.int32), cache)
  prompt_logits = np.asarray(logits[0])
  tokens = [int(np.argmax(prompt_logits[-1]))]
  while len(tokens) < NUM_NEW:
    logits, cache = _step(config, params, jnp.asarray([[tokens[-1]]], jnp.int32), cache)
    tokens.append(int(jnp.argmax(logits[0, -1])))
  return prompt_logits, tokens


def transformers_reference(path: str, prompt: list[int]) -> tuple[np.ndarray, list[int]]:
  """transformers' logits [T, V] and NUM_NEW greedy tokens for `prompt`, from the same GGUF file."""
  reference = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                                dtype=torch.float32).eval()
  with torch.no_grad():
    want = reference(torch.tensor([prompt])).logits[0].numpy()
    generated = reference.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW,
                                   do_sample=False)[0, len(prompt):].tolist()
  return want, generated


def _prompt(model) -> list[int]:
  """The chat-templated code prompt; for a base model without a template (gemma-3-270m) 600 tokens of
  text, longer than its 512-position sliding window, so the local layers' window and the global layers
  both shape the logits."""
  tokenizer = model.tokenizer
  if tokenizer.chat_template is None:
    prompt = tokenizer.encode("\n".join(TEXTS[:2] * 40))[:600]
    assert len(prompt) > model.config.sliding_window
    return prompt
  return tokenizer.encode(tokenizer.apply_chat_template(CODE_PROMPT), add_special_tokens=False)


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "gemma-3-270m"])
def test_logits_and_greedy_match_transformers(name):
  path = installed_or_skip(name)
  ours = load_model(name)
  prompt = _prompt(ours)
  prompt_logits, tokens = specjax_greedy(ours.config, ours.params, prompt)
  want, generated = transformers_reference(path, prompt)
  diff = float(np.max(np.abs(prompt_logits - want)))
  print(f"\n{name}: {len(prompt)} prompt tokens, max |logit difference| {diff:.2e} "
        f"(logits span {want.min():.1f}..{want.max():.1f})\n  specjax: {ours.tokenizer.decode(tokens)!r}")
  assert diff < 2e-3
  assert tokens == generated


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "gemma-3-270m"])
def test_tokenizer_matches_transformers(name):
  """SmolLM's digit split is absent from transformers' GGUF conversion; these texts avoid runs of
  spaces before digits, where the two differ (see tests/test_tokenizer.py)."""
  path = installed_or_skip(name)
  ours = Tokenizer.from_gguf(path)
  reference = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
  texts = [re.sub(r"\s+(?=\d)", " ", t) for t in TEXTS] if name.startswith("smollm") else TEXTS
  for text in texts:
    ids = reference.encode(text)
    assert ours.encode(text) == ids
    assert ours.decode(ids) == reference.decode(ids)
  if ours.chat_template is None:  # gemma-3-270m is a base model
    assert reference.chat_template is None
    return
  messages = [{"role": "system", "content": "You write code."}, {"role": "user", "content": CODE_PROMPT}]
  assert ours.apply_chat_template(messages) == reference.apply_chat_template(messages, tokenize=False,
                                                                             add_generation_prompt=True)


def test_qwen_pair_shares_one_tokenizer():
  draft = Tokenizer.from_gguf(installed_or_skip("qwen2.5-coder-0.5b-instruct"))
  target = Tokenizer.from_gguf(installed_or_skip("qwen2.5-coder-1.5b-instruct"))
  assert draft.fingerprint() == target.fingerprint()
  assert draft.eos_ids == target.eos_ids == (151643, 151645)
  assert Tokenizer.from_gguf(installed_or_skip("smollm2-135m-instruct")).fingerprint() != draft.fingerprint()


def test_gemma3_270m_is_the_published_size():
  installed_or_skip("gemma-3-270m")
  config = load_model("gemma-3-270m").config
  assert config.vocab_size == 262_144 and round(config.num_params() / 1e6) == 268
