"""Every field of a decode config (`python -m specjax.decode`, `experiments.sweep`), with its default and
meaning; configs/*.py start from `default_config()` and override what their experiment needs.

No field is `None`: placeholders are typed ("" for paths), so `--config.FIELD=VALUE` overrides parse and
`lock_config` rejects misspelt fields.
"""

from __future__ import annotations

import ml_collections


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.target = ""  # .gguf file, HF directory, registry name or hub name org/name[@revision] (required)
  c.mode = "speculative"  # "speculative" or "autoregressive" (the target alone: the baseline)
  c.drafter = "model"  # what proposes the draft tokens: "model" | "ngram" | "layer_skip" | "eagle" (see README)
  c.draft = ""  # drafter "model": the draft model (as target; same tokenizer, head may be padded);
  #               drafter "eagle": the head's directory (specjax's or EAGLE-3's layout)
  c.draft_vocab = 0  # drafters "model", "eagle": > 0 scores only this many most frequent tokens (0 = all)
  c.draft_vocab_corpus = "stdlib"  # corpus ranking them: "stdlib", a directory, glob, text or JSONL file
  c.draft_stop_threshold = 0.0  # drafter "model": a row stops drafting when the draft's top probability
  #                               falls below this (0 = off; in [0, 1))
  c.tree = ""  # drafter "model": draft a static tree each round, "(4,2,2,1)" (children per node at each
  #              depth) or a path list "[[0],[1],[0,0]]", or a dynamic (EAGLE-2) tree per row and round,
  #              "dynamic(16,6,4)" (N nodes, depth D, b children per expanded node); "" = a chain of k
  #              tokens (k is then the depth)
  c.tree_children = "iid"  # drafter "model" with a static tree at T > 0: "iid" draws,
  #                          "without_replacement", or the "top" tokens (point masses); greedy, and
  #                          dynamic trees, always take the top tokens
  c.ngram_min = 1  # drafter "ngram": shortest suffix of the history looked up (>= 1)
  c.ngram_max = 3  # drafter "ngram": longest suffix looked up (>= ngram_min); the longest match wins
  c.draft_layers = ""  # drafter "layer_skip": the target's layers that draft, e.g. "0-11" or "0,2,4-9,27"
  c.prompts = ("Write a Python function that checks whether a string is a palindrome.",)  # a tuple
  c.prompts_file = ""  # one prompt per line, or .jsonl with a "prompt" field; overrides prompts
  c.chat = True  # wrap each prompt in the tokenizer's chat template
  c.max_new_tokens = 128  # budget per prompt (EOS may stop a row earlier)
  c.k = 5  # draft tokens proposed per round (the most a round can propose)
  c.temperature = 0.0  # 0 = greedy (output equals the target's own greedy output)
  c.top_k = 0  # 0 disables top-k
  c.top_p = 1.0  # 1 disables top-p
  c.seed = 0  # PRNG seed for sampling
  c.batch_size = 1  # prompts decoded together; each row accepts its own number of tokens
  c.dtype = "float32"  # "float32" on CPU; "bfloat16" on GPU/TPU
  c.scan_layers = "auto"  # "on": layers stacked and run by lax.scan (compile time flat in depth);
  #                         "off": unrolled; "auto": on for GPU/TPU, off on CPU (see README)
  c.attention_block = 256  # keys per block of the live-length attention (0 = dense over the cache)
  c.prefill_chunk = 512  # prompt tokens per prefill pass (peak memory ~ chunk x live keys)
  c.mesh = ""  # devices as "data=2,model=4" (batch rows over data, weights' heads/MLP/vocabulary over
  #              model; -1 = the remaining devices); "" = one device (see README, "Several devices")
  c.mesh_indivisible = "error"  # a weight axis (heads, MLP, vocabulary) that does not split over its mesh
  #                               axis: "error", or "replicate" it on every device
  c.draft_sharding = "same"  # the draft model's weights: "same" rules as the target, or "replicated"
  c.output = ""  # path of a JSON results file; empty = print only
  return c
