"""Padded vocabularies: a draft and a target with one tokenizer but heads of different sizes (Qwen2.5-0.5B
scores 151,936 ids, Qwen2.5-7B 152,064) decode together exactly, in both directions (draft smaller, the
common case, and draft larger). The rule: the smaller distribution is extended with probability 0.

What is checked, from the rule to the pipeline:
- The rule alone: one step's output distribution equals q exactly (enumerated over the draft token)
  when p spans W = V - 3 or V + 3 ids; the jitted `verify` agrees by Monte Carlo.
- The engine, greedy: output equal to the target's greedy output token for token, with prompts and
  target tokens the smaller draft cannot embed (ids >= W are fed to it as its last id; without that
  its cache fills with NaN and it never gets a token accepted again, which the test would see).
- The engine, sampled: the joint distribution of the first 3 generated tokens (K = 1: the prefill's
  token, round one's draft position, then its bonus or round two's first token) over N = SAMPLE_ROWS seeded
  rows, by a chi-square test at level ALPHA = 0.001 against the target's exact distribution
  (enumerated), at T = 0.7 with top-k 3 and T = 1.5 with top-p 0.8, in both directions. A deliberately
  wrong extension must fail the same test with p < 1e-6: cutting the target to the draft's ids and
  renormalising (draft smaller: the target's own extra ids are never emitted), and renormalising the
  draft on the target's ids (draft larger: its mass on ids the target lacks is wrongly moved onto the
  shared ones, so shared ids are accepted too rarely). Fixed seeds: the outcomes are deterministic;
  the correct rule gives p = 0.03-0.08, the wrong extensions score statistics of 136,826 on 22
  degrees of freedom (draft smaller) and 2,675 on 20 (draft larger): p underflows to 0, every draw
  inside the target's support, so the statistic itself rejects.
- The pipeline: HF directories whose heads differ only in padding rows (made with `transformers`'
  `resize_token_embeddings`) decode to the autoregressive output, even when the padded model's
  tokenizer names extra tokens in its padding range; tokenizers that differ on the shared range are
  refused with one clear error.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from scipy import stats

from configs import tiny
from specjax import metrics, pipeline, testing
from specjax.generation import as_token_lists, pad_prompts
from specjax.sampling import sampling_params
from specjax.speculative import ModelDrafter, proposal, residual, verify
from specjax.speculative.loop import SpeculativeLoop
from specjax.speculative.plan import RoundPlan
from tests.helpers import tiny_hf
from tests.helpers.engine import (TARGET, VOCAB, exact_distribution, perturbed, run_speculative, target_greedy,
                                  tiny_model)
from tests.helpers.stats import SAMPLE_ROWS, chi_square_pvalue

ALPHA = 1e-3  # level of every chi-square test of the correct rule
REJECTED = 1e-6  # a wrong extension must give a p-value below this


def _with_vocab(model, vocab, seed=0, scale=0.3):
  """`model` with its embedding and output head cut to `vocab` rows, or extended by random rows of
  std `scale` (padding rows that, unlike trained ones, get real probability)."""
  config, params = model
  rng = np.random.default_rng(seed)

  def resize(table_VxD):
    extra = vocab - table_VxD.shape[0]
    if extra <= 0:
      return table_VxD[:vocab]
    return jnp.concatenate([table_VxD, jnp.asarray(rng.normal(0.0, scale, (extra, config.d_model)), jnp.float32)])

  params = dict(params, embed={"embedding": resize(params["embed"]["embedding"])},
                lm_head={"weight": resize(params["lm_head"]["weight"])})
  return config.replace(vocab_size=vocab), params


# --- the rule alone ---------------------------------------------------------------------------------


def _random_pair(rng, target_vocab, draft_vocab):
  return (rng.dirichlet(np.ones(draft_vocab)).astype(np.float32),
          rng.dirichlet(np.ones(target_vocab)).astype(np.float32))


@pytest.mark.parametrize("draft_vocab", [7, 13])
def test_one_step_output_is_exactly_q_for_another_draft_vocabulary(draft_vocab):
  """V = 10, W = 7 or 13: P(out = y) = p(y) min(1, q(y) / p(y)) + P(reject) residual(q, p)(y), with
  q = 0 on ids >= V and p = 0 on ids >= W, enumerated: equal to q within 1e-6."""
  vocab = 10
  for seed in range(3):
    p_W, q_V = _random_pair(np.random.default_rng(seed), vocab, draft_vocab)
    width = max(vocab, draft_vocab)
    p, q = (np.pad(np.float64(a), (0, width - len(a))) for a in (p_W, q_V))
    accepted = np.minimum(p, q)  # draft token y drawn with p(y), kept with min(1, q(y) / p(y))
    left_V = np.float64(residual(jnp.asarray(q_V), jnp.asarray(p_W)))
    assert left_V.shape == (vocab,)
    output = accepted[:vocab] + (1.0 - accepted.sum()) * left_V
    assert accepted[vocab:].sum() == 0.0  # ids the target lacks are never emitted
    np.testing.assert_allclose(output, q_V, atol=1e-6)


@pytest.mark.parametrize("draft_vocab", [7, 13])
def test_verify_emits_q_for_another_draft_vocabulary(draft_vocab):
  """K = 1, N = 200,000 rows, drafts drawn from p over W ids: the emitted token (the accepted draft or
  the residual's draw) follows q over V = 10 ids (chi-square at level 0.001); drafts >= V are never
  accepted."""
  vocab, rows = 10, 200_000
  rng = np.random.default_rng(5)
  p_W, q_V = _random_pair(rng, vocab, draft_vocab)
  bonus_V = rng.dirichlet(np.ones(vocab)).astype(np.float32)
  draft_B = rng.choice(draft_vocab, rows, p=np.float64(p_W) / np.float64(p_W).sum()).astype(np.int32)
  num_accepted, next_token = jax.jit(verify)(jax.random.key(6),
                                             proposal.full(jnp.asarray(draft_B[:, None]),
                                                           jnp.broadcast_to(jnp.asarray(p_W), (rows, 1, draft_vocab))),
                                             jnp.broadcast_to(jnp.asarray(np.stack([q_V, bonus_V])), (rows, 2, vocab)))
  num_accepted, next_token = np.asarray(num_accepted), np.asarray(next_token)
  assert not num_accepted[draft_B >= vocab].any()
  emitted_B = np.where(num_accepted == 1, draft_B, next_token)
  assert chi_square_pvalue(np.bincount(emitted_B, minlength=vocab), np.float64(q_V)) > ALPHA
  assert stats.binomtest(int(num_accepted.sum()), rows, np.minimum(p_W[:vocab], q_V[:draft_vocab]).sum()).pvalue > ALPHA


# --- the engine, greedy -----------------------------------------------------------------------------

SMALLER_VOCAB = VOCAB - 9  # the target's greedy output holds ids 52, 54 and 55 beyond it
SMALLER_DRAFT = _with_vocab(TARGET, SMALLER_VOCAB)  # the target's own weights, 9 fewer rows
LARGER_DRAFT = _with_vocab(perturbed(TARGET, 0.01, seed=7), VOCAB + 3, seed=1, scale=0.6)


@pytest.mark.parametrize("draft_name", ["smaller", "larger"])
def test_greedy_equals_target_greedy_with_a_padded_head(draft_name):
  """K = 3, the prompts and budgets of `helpers.engine`: a prompt holds id 60 and the target emits
  52 .. 55, ids the smaller draft cannot embed; the larger draft proposes padding ids, which the
  target must be fed (as its last id: it lacks them) and always rejects."""
  draft = {"smaller": SMALLER_DRAFT, "larger": LARGER_DRAFT}[draft_name]
  out = run_speculative(draft, k=3)
  expected = target_greedy()
  assert as_token_lists(out.tokens, out.counts) == expected
  total = metrics.summarize(out.acceptance)["total"]
  assert 0 < total["accepted"] < total["proposed"]
  if draft_name == "smaller":
    assert any(t >= SMALLER_VOCAB for row in expected for t in row)  # the target emits ids the draft lacks


def test_a_smaller_draft_reads_ids_it_lacks_as_its_last_id():
  """Prompts and a pending token holding ids >= W: the draft's sampled proposal (K = 2) equals the one
  for the same inputs with those ids replaced by W - 1, and is finite (fed as they are, `jnp.take`
  would embed them as NaN)."""
  drafter, last = ModelDrafter(*SMALLER_DRAFT), SMALLER_VOCAB - 1
  prompts, pending = [[5, 60, 3], [SMALLER_VOCAB, 2]], [57, 4]
  propose = jax.jit(ModelDrafter.propose)

  def probs(prompts, pending):
    padded, lengths = pad_prompts(prompts)
    state = jax.jit(ModelDrafter.init)(drafter, drafter.storage(2, 16), padded, lengths, None)
    proposal_, _, _ = propose(drafter, state, None, jnp.asarray(pending), sampling_params(1.0), jax.random.key(0),
                              RoundPlan(2))
    return np.asarray(proposal_.probs)

  got_BxKxW = probs(prompts, pending)
  assert got_BxKxW.shape == (2, 2, SMALLER_VOCAB) and np.isfinite(got_BxKxW).all()
  clamped = lambda ids: [min(t, last) for t in ids]
  np.testing.assert_array_equal(got_BxKxW, probs([clamped(p) for p in prompts], clamped(pending)))


# --- the engine, sampled ----------------------------------------------------------------------------

ROWS, STEPS, K, SEED = SAMPLE_ROWS, 3, 1, 1
SAMPLINGS = {"t0.7_top_k3": sampling_params(0.7, top_k=3), "t1.5_top_p0.8": sampling_params(1.5, top_p=0.8)}


def _pairs():
  """(target, draft, prompt) per direction; vocabularies 10 / 8 (draft smaller: the prompt's 9 is an id
  the draft lacks) and 8 / 10 (draft larger, its two extra rows random: ~20% of its mass)."""
  big = tiny_model(10, vocab=10, n_layers=2, scale=0.5)
  small = tiny_model(10, vocab=8, n_layers=2, scale=0.5)
  return {
      "smaller": (big, _with_vocab(perturbed(big, 0.05, seed=11), 8), [3, 9, 4]),
      "larger": (small, _with_vocab(perturbed(small, 0.05, seed=11), 10, seed=2, scale=0.5), [3, 1, 4])
  }


PAIRS = _pairs()


def _renormalised(probs_xV):
  return probs_xV / probs_xV.sum(axis=-1, keepdims=True)


def _target_cut_to_the_draft(key, proposal_, target_probs_BxK1xV):
  """Wrong: the target cut to the draft's W ids and renormalised (the target 'extended' to the draft)."""
  return verify(key, proposal_, _renormalised(target_probs_BxK1xV[..., :proposal_.probs.shape[-1]]))


def _draft_renormalised_on_the_target(key, proposal_, target_probs_BxK1xV):
  """Wrong: the draft cut to the target's V ids and renormalised, as if it had never drawn the others."""
  cut_BxKxV = _renormalised(proposal_.probs[..., :target_probs_BxK1xV.shape[-1]])
  return verify(key, proposal_.replace(probs=cut_BxKxV), target_probs_BxK1xV)


WRONG_EXTENSIONS = {"smaller": _target_cut_to_the_draft, "larger": _draft_renormalised_on_the_target}


def _first_tokens(direction, sampling, rule):
  """[ROWS, STEPS] tokens of one seeded call, K = 1, caches sized exactly."""
  (target_config, target_params), draft, prompt = PAIRS[direction]
  request = testing.request([prompt] * ROWS, STEPS, sampling, seed=SEED)
  out = testing.speculate(SpeculativeLoop(target_config, K, rule=rule), target_params, ModelDrafter(*draft), request,
                          cache_len=len(prompt) + STEPS + K - 1)
  return np.asarray(out.tokens)


def _pvalue(direction, name, tokens_ZxT):
  """Chi-square p-value of the rows' tokens against the target's exact joint distribution."""
  (target_config, target_params), _, prompt = PAIRS[direction]
  vocab = target_config.vocab_size
  assert tokens_ZxT.max() < vocab
  exact = exact_distribution(target_config, target_params, prompt, SAMPLINGS[name], STEPS).ravel()
  counts = np.bincount(np.ravel_multi_index(tokens_ZxT.T, [vocab] * STEPS), minlength=vocab**STEPS)
  return chi_square_pvalue(counts, exact)


@pytest.mark.slow
@pytest.mark.parametrize("direction, name", [("smaller", "t0.7_top_k3"), ("larger", "t1.5_top_p0.8")])
def test_sampled_tokens_follow_the_target_with_a_padded_head(direction, name):
  """Chi-square at level 0.001 on N = SAMPLE_ROWS rows over the first 3 tokens; each direction with one of
  the two sampling settings (top-k for the smaller draft, top-p for the larger one)."""
  assert _pvalue(direction, name, _first_tokens(direction, SAMPLINGS[name], verify)) > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("direction", sorted(PAIRS))
def test_a_wrong_extension_fails_the_same_test(direction):
  """The same statistic (T = 0.7, top-k 3, N = SAMPLE_ROWS) rejects the wrong extension with p < 1e-6."""
  name = "t0.7_top_k3"
  tokens_ZxT = _first_tokens(direction, SAMPLINGS[name], WRONG_EXTENSIONS[direction])
  assert _pvalue(direction, name, tokens_ZxT) < REJECTED


# --- the pipeline -----------------------------------------------------------------------------------

PADDED_ROWS = tiny_hf.VOCAB + 7  # 104 rows for the character tokenizer's 97 ids


def _hf_dir(root, name, seed, rows=tiny_hf.VOCAB, extra_tokens=(), swap=None):
  """A tiny qwen2 HF directory with the character tokenizer: its head padded to `rows` by
  `transformers`' `resize_token_embeddings`, its tokenizer naming `extra_tokens` after the 97 ids, or
  with the ids of the two characters `swap` exchanged."""
  directory = root / name
  model = tiny_hf.make_hf_model("qwen2", seed)
  if rows != tiny_hf.VOCAB:
    model.resize_token_embeddings(rows)
  model.save_pretrained(str(directory))
  tiny_hf.save_char_tokenizer(str(directory))
  backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
  backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in extra_tokens])
  backend.save(str(directory / "tokenizer.json"))
  if swap:
    table = json.loads((directory / "tokenizer.json").read_text())
    vocab = table["model"]["vocab"]
    vocab[swap[0]], vocab[swap[1]] = vocab[swap[1]], vocab[swap[0]]
    (directory / "tokenizer.json").write_text(json.dumps(table))
  return str(directory)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("padded")
  return {
      "plain": _hf_dir(root, "plain", seed=0),
      # padded head, and a tokenizer that names two more tokens inside the padding rows
      "padded": _hf_dir(root, "padded", seed=1, rows=PADDED_ROWS, extra_tokens=("<x0>", "<x1>")),
      "swapped": _hf_dir(root, "swapped", seed=1, rows=PADDED_ROWS, swap=("a", "b"))
  }


def _run(target, draft, **overrides):
  cfg = tiny.get_config()
  cfg.target, cfg.draft = target, draft
  cfg.update(overrides)
  return pipeline.run(cfg, log=lambda message: None)


@pytest.mark.parametrize("target, draft", [("padded", "plain"), ("plain", "padded")])
def test_pipeline_decodes_a_pair_differing_in_padding_rows(hf_dirs, target, draft):
  """Heads of 104 and 97 rows, tokenizers equal on the 97 shared ids (the padded one names 2 more):
  accepted, and the greedy speculative output equals the target's autoregressive one."""
  spec = _run(hf_dirs[target], hf_dirs[draft])
  alone = _run(hf_dirs[target], hf_dirs[draft], mode="autoregressive")
  assert [o["token_ids"] for o in spec["outputs"]] == [o["token_ids"] for o in alone["outputs"]]
  assert spec["stats"]["generated_tokens"] > 0


def test_pipeline_refuses_tokenizers_that_differ_on_the_shared_range_when_told(hf_dirs):
  """Two ids below 97 exchanged and other_tokenizer "refuse": refused before decoding, with one line naming
  the models, the range and the setting."""
  cfg = tiny.get_config()
  cfg.target, cfg.draft, cfg.model.other_tokenizer = hf_dirs["plain"], hf_dirs["swapped"], "refuse"
  with pytest.raises(
      ValueError, match=r"^draft swapped and target plain have different tokenizers: some id "
      r"below 97 \(the range both heads score\) maps to different tokens "
      r"\(config.model.other_tokenizer is 'refuse'\)$"):
    pipeline.run(cfg, log=lambda message: None)
