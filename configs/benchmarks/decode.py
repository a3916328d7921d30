"""The decode benchmark (`python -m experiments.benchmark_decode --config=configs/benchmarks/decode.py`):
specjax autoregressive, specjax speculative (a K sweep, each K with every draft head size) and
`transformers` plain and assisted generation on the real pair, greedy, the same chat prompts, one JSON.

The committed runs (experiments/README.md) overrode the grid, e.g.

  python -m experiments.benchmark_decode --config=configs/benchmarks/decode.py --config.num_prompts=3 \
      --config.batched_ks='(4,)' --config.ar_every=4 --config.output=experiments/results/decode_cpu_float32.json
"""

import ml_collections


def get_config():
  cfg = ml_collections.ConfigDict()
  cfg.target = "qwen2.5-coder-1.5b-instruct"  # registry name, .gguf file or HF directory
  cfg.draft = "qwen2.5-coder-0.5b-instruct"  # the draft model (same tokenizer); also transformers' assistant
  cfg.dtype = "float32"  # "float32" on CPU; "bfloat16" on GPU/TPU
  cfg.max_new_tokens = 128  # budget per prompt (EOS may stop a row earlier)
  cfg.num_prompts = 4  # the first N chat prompts of benchmark_decode.PROMPTS (1..4)
  cfg.batch_sizes = (1, 4)  # specjax batch sizes; each runs its own autoregressive baseline
  cfg.ks = tuple(range(1, 9))  # K values of the speculative runs at batch size 1
  cfg.batched_ks = (3, 5)  # K values of the speculative runs at batch sizes > 1
  cfg.draft_vocabs = (0, 32768)  # draft head sizes (decode field draft_vocab; 0 = full vocabulary), each at every K
  cfg.hf_batch_sizes = (1, 4)  # batch sizes of transformers' plain generate (assisted generation: batch 1)
  cfg.repeats = 5  # timed forwards per cost measurement (T-token forwards, c); the median is kept
  cfg.ar_every = 6  # rerun the autoregressive baseline after this many speculative configs (and last)
  cfg.systems = ("specjax", "transformers")  # what runs; transformers needs specjax (its input ids, reference)
  cfg.output = "experiments/results/decode_cpu_float32.json"  # the JSON results, rewritten after each system
  cfg.report = ""  # a results file to print the tables of, instead of running anything
  return cfg
