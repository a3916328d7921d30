"""Tiny drafts with another vocabulary than their target's, for the engine tests of drafting through the
token-level intersection: the pairing of ids, the spelling of every target id as draft ids, and a draft
built from the target's own weights on the intersection (so that it agrees with the target where its
history holds only intersection tokens, and acceptance is high enough to reach every code path)."""

import jax
import jax.numpy as jnp
import numpy as np

from specjax import testing
from specjax.generation import pad_prompts
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import forward
from specjax.speculative.drafters.draft_head import intersection_head
from specjax.speculative.drafters.model import ModelDrafter
from specjax.speculative.drafters.spelling import Spelling
from specjax.speculative.k_policy import Tables
from specjax.speculative.loop import SpeculativeLoop
from tests.helpers.engine import BUDGETS, CACHE_LEN, GREEDY, NO_EOS, OUT_WIDTH, PROMPTS, TARGET, tiny_model
from tests.helpers.tiny_hf import save_hf_model
from tests.helpers.tokenizers import OTHER_SOURCES, save_hf_dir, train_tokenizer


def vocabularies(target_vocab: int, draft_vocab: int, shared: int, max_ids: int, seed: int):
  """(draft ids [I], target ids [I], spelling ids [V, M], counts [V]): `shared` random pairs; a paired
  target id is spelled as its partner, every other one as 1 .. M random draft ids (at least one 2 and
  one M long)."""
  rng = np.random.default_rng(seed)
  target_I = np.sort(rng.choice(target_vocab, shared, replace=False))
  draft_I = rng.choice(draft_vocab, shared, replace=False)
  ids_VxM = np.zeros((target_vocab, max_ids), np.int32)
  counts_V = np.ones(target_vocab, np.int32)
  ids_VxM[target_I, 0] = draft_I
  others = np.setdiff1d(np.arange(target_vocab), target_I)
  for n, t in enumerate(others):
    counts_V[t] = [2, max_ids][n] if n < 2 else rng.integers(1, max_ids + 1)
    ids_VxM[t, :counts_V[t]] = rng.integers(0, draft_vocab, counts_V[t])
  return draft_I.astype(np.int32), target_I.astype(np.int32), ids_VxM, counts_V


def agreeing_draft(target, draft_vocab: int, draft_I: np.ndarray, target_I: np.ndarray, seed: int):
  """A draft of `draft_vocab` ids whose embedding and output rows at `draft_I` are the target's at
  `target_I` (other rows random) and whose blocks are the target's."""
  config, params = target
  draft_config, draft_params = tiny_model(seed, vocab=draft_vocab, d_model=config.d_model, n_layers=config.n_layers)
  rows = lambda own, theirs: jnp.asarray(own).at[draft_I].set(jnp.asarray(theirs)[target_I])
  params = dict(params, embed={"embedding": rows(draft_params["embed"]["embedding"], params["embed"]["embedding"])},
                lm_head={"weight": rows(draft_params["lm_head"]["weight"], params["lm_head"]["weight"])})
  return draft_config, params


def spelling_drafter(target, draft_vocab: int = 50, shared: int = 40, max_ids: int = 3, seed: int = 0,
                     **fields) -> tuple[ModelDrafter, tuple]:
  """A model drafter for `target` with another vocabulary (`vocabularies`, `agreeing_draft`), and the
  tables (draft ids, target ids, spelling ids, counts) it was built from."""
  tables = vocabularies(target[0].vocab_size, draft_vocab, shared, max_ids, seed)
  draft_I, target_I, ids_VxM, counts_V = tables
  config, params = agreeing_draft(target, draft_vocab, draft_I, target_I, seed + 100)
  head = intersection_head(config, params, draft_I, target_I, target[0].vocab_size)
  spelling = Spelling(ids_VxM=jnp.asarray(ids_VxM), counts_V=jnp.asarray(counts_V))
  return ModelDrafter(config, params, head, spelling=spelling, **fields), tables


def run_drafter(drafter, target=TARGET, prompts=PROMPTS, budgets=BUDGETS, eos_ids=NO_EOS, k=3, sampling=GREEDY, seed=0,
                cache_len=CACHE_LEN, out_width=OUT_WIDTH, tables=Tables(), **settings):
  """Speculative decoding of `prompts` by `target` with `drafter` (its storage sized by itself);
  `settings` are the loop's (`SpeculativeLoop`), `tables` the K policy's."""
  target_config, target_params = target
  return testing.speculate(SpeculativeLoop(target_config, k, out_width, **settings), target_params, drafter,
                           testing.request(prompts, budgets, sampling, seed=seed, eos_ids=eos_ids), cache_len=cache_len,
                           tables=tables)


def bpe_pair_dirs(tmp_path):
  """HF directories of a tiny qwen2 target with a Qwen2-style BPE of 600 tokens and a draft with a
  GPT-2-style BPE of 900 trained on other sources (a few hundred shared byte strings, ids unrelated), and
  a small text corpus file."""
  dirs = []
  for name, tokenizer, seed in (("target", train_tokenizer("qwen2"), 0), ("draft",
                                                                          train_tokenizer("gpt2", OTHER_SOURCES,
                                                                                          900), 1)):
    directory = str(tmp_path / name)
    save_hf_model("qwen2", directory, seed=seed, vocab=tokenizer.get_vocab_size())
    save_hf_dir(tokenizer, directory)
    dirs.append(directory)
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("def add(a, b):\n    return a + b\n\nimport json\nprint(json.dumps({'a': [1, 2]}))\n")
  return dirs, corpus


def spell_history(history, ids_VxM, counts_V):
  """The draft ids spelling the target ids `history` (the spelling table's rows, counts)."""
  return [int(i) for t in history for i in ids_VxM[t, :counts_V[t]]]


FORCED_PROMPTS, FORCED_CACHE = [[4, 8, 15], [16, 23], [42, 7, 9, 1]], 96


def forced_rounds(**fields):
  """A spelling drafter (`fields`: its tree) initialised on FORCED_PROMPTS, its tables, its compiled
  `propose` and `commit`, the draft's logits of whole draft-id sequences [B, FORCED_CACHE] and the
  target ids outside the intersection: the kit of the tests that force each round's outcome."""
  drafter, tables = spelling_drafter(TARGET, **fields)
  config, params, batch = drafter.config, drafter.params, len(FORCED_PROMPTS)
  padded, lengths = pad_prompts(FORCED_PROMPTS)
  state = jax.jit(ModelDrafter.init)(drafter, drafter.storage(batch, FORCED_CACHE // 3), padded, lengths, None)
  score = jax.jit(lambda tokens_BxT: forward(config, params, tokens_BxT, init_cache(config, batch, FORCED_CACHE))[0])
  outside = np.setdiff1d(np.arange(TARGET[0].vocab_size), tables[1])
  return (drafter, tables, state, jax.jit(ModelDrafter.propose), jax.jit(ModelDrafter.commit), score, outside)
