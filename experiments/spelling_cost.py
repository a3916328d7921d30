"""What a draft with another tokenizer loses by reading the text spelled per target token
(`specjax/speculative/drafters/spelling.py`) instead of its own tokenization of the whole text.

For every output of a decode results file (the target's tokens after its chat-templated prompt), at each
generated position j the draft predicts the target's token j from the history before it, restricted to
the token-level intersection (as it drafts), read two ways:
  spelled    the history as the drafter feeds it: each target token spelled as draft ids (cut to M)
  canonical  the history's text re-encoded by the draft's own tokenizer (what re-tokenizing costs nothing
             to compare with: one forward pass per position)
Greedy agreement (the draft's argmax is the target's token) is the first draft token's acceptance at
temperature 0; the expected acceptance sum_x min(p(x), q_onehot(x)) = p(target token) is the same at
temperature 1 against a target that is sure. Both are reported, with the share of generated tokens in the
intersection (the ceiling). JSON out.

  python -m experiments.spelling_cost --config=configs/benchmarks/spelling_cost.py
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments import harness
from specjax import prompts, records
from specjax.models import vocab_map
from specjax.models.kv_cache import init_cache
from specjax.models.load import load_model, load_tokenizer
from specjax.models.transformer import forward
from specjax.speculative.drafters import spelling as spelling_lib


def _restricted_log_probs(logits_TxW: np.ndarray, draft_I: np.ndarray) -> np.ndarray:
  """log p over the intersection [T, I] (the drafter's renormalised distribution)."""
  restricted = logits_TxW[:, draft_I].astype(np.float64)
  return restricted - np.logaddexp.reduce(restricted, axis=-1, keepdims=True)


def run(cfg: ml_collections.ConfigDict, log: harness.Log = print) -> dict:
  with open(cfg.source) as f:
    source = json.load(f)
  log(f"loading target tokenizer {cfg.target} and draft {cfg.draft} ...")
  (target_tokenizer, target_config), draft = load_tokenizer(cfg.target), load_model(cfg.draft, "float32")
  vocab = vocab_map.between((target_tokenizer, target_config), (draft.tokenizer, draft.config))
  table, _ = spelling_lib.spelling(vocab, cfg.max_spelling)
  ids_VxM, counts_V = np.asarray(table.ids_VxM), np.asarray(table.counts_V)
  draft_I, target_of_I = vocab.draft_ids_I, vocab.target_ids_I
  width = cfg.width
  logits_fn = jax.jit(
      lambda params, ids_1xT: forward(draft.config, params, ids_1xT, init_cache(draft.config, 1, width))[0][0])

  def logits_after(ids: list[int]) -> np.ndarray:
    if len(ids) > width:
      raise ValueError(f"a history of {len(ids)} draft ids exceeds config.width {width}")
    return np.asarray(logits_fn(draft.params, jnp.asarray([ids + [0] * (width - len(ids))], jnp.int32)))

  rows = {"spelled": {"agree": 0, "p_target": 0.0}, "canonical": {"agree": 0, "p_target": 0.0}}
  positions = shared = 0
  for output in source["outputs"]:
    prompt = prompts.encode(target_tokenizer, [output["prompt"]], cfg.chat)[0]
    generated = output["token_ids"][:cfg.positions_per_output]
    spelled = [int(i) for t in prompt + generated for i in ids_VxM[t, :counts_V[t]]]
    spelled_logits_TxW = logits_after(spelled)
    ends = np.cumsum([counts_V[t] for t in prompt + generated])
    for j, token in enumerate(generated):
      canonical = draft.tokenizer.encode(target_tokenizer.decode(prompt + generated[:j]), add_special_tokens=False)
      histories = {
          "spelled": spelled_logits_TxW[ends[len(prompt) + j - 1] - 1], "canonical": logits_after(canonical)
                                                                                     [len(canonical) - 1]
      }
      for way, logits_W in histories.items():
        log_p_I = _restricted_log_probs(logits_W[None], draft_I)[0]
        rows[way]["agree"] += int(target_of_I[np.argmax(log_p_I)] == token)
        hit = np.flatnonzero(target_of_I == token)
        rows[way]["p_target"] += float(np.exp(log_p_I[hit[0]])) if hit.size else 0.0
      positions += 1
      shared += int(vocab.target_to_draft_V[token] >= 0)
  results = {
      "command": records.command(), "source": cfg.source, "target": cfg.target, "draft": cfg.draft,
      "max_spelling": cfg.max_spelling, "positions": positions, "in_intersection": shared / positions, "ways": {
          way: {"greedy_agreement": r["agree"] / positions, "mean_p_of_target_token": r["p_target"] / positions}
          for way, r in rows.items()
      }
  }
  for way, r in results["ways"].items():
    log(f"{way:10s} greedy agreement {r['greedy_agreement']:.3f}, mean draft p(target token) "
        f"{r['mean_p_of_target_token']:.3f} over {positions} positions ({shared / positions:.1%} in the intersection)")
  if cfg.output:
    harness.write_results(results, cfg.output)
  return results


def main(cfg: ml_collections.ConfigDict) -> None:
  run(cfg, log=harness.log)


if __name__ == "__main__":
  harness.run_script(main, "Benchmark config (configs/benchmarks/spelling_cost.py).")
