"""Cost of a T-token forward pass relative to a 1-token step, under several XLA CPU settings.

Speculative decoding on a CPU is limited by the verify pass (K + 1 tokens at once): this measures
T = 1..9 for the target's shape (Qwen2.5-Coder-1.5B dimensions, random weights, float32; `--layers`
trims the depth to keep the run short; the head is full size) in one subprocess per XLA setting, so
that every variant runs on the same machine in one run. Writes a JSON result.

  python experiments/forward_cost.py --out experiments/results/forward_cost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

VARIANTS = {
    "default": "",
    "xnnpack": "--xla_cpu_use_xnnpack=true",
    "onednn": "--xla_cpu_use_onednn=true",
    "no_thunks": "--xla_cpu_use_thunk_runtime=false",
}


def measure(layers: int, tokens: list[int], repeats: int, cache_len: int) -> dict[int, float]:
  """Median seconds of one jitted forward of T tokens at a cache offset of 100."""
  import numpy as np

  from specjax import costs
  from specjax.models.config import ModelConfig
  from specjax.models.param_tree import assemble_params, expected_shapes

  config = ModelConfig(arch="llama", vocab_size=151936, d_model=1536, n_layers=layers, n_heads=12,
                       n_kv_heads=2, head_dim=128, d_ff=8960, qkv_bias=True, rope_theta=1e6)
  rng = np.random.default_rng(0)
  params = assemble_params(config, {path: rng.standard_normal(shape, dtype=np.float32) * 0.02
                                    for path, shape in expected_shapes(config).items()}, "random")

  return costs.forward_seconds(config, params, tokens, repeats, cache_len=cache_len)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=28)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--cache-len", type=int, default=512)
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--out", default="")
  parser.add_argument("--child", default="", help=argparse.SUPPRESS)
  args = parser.parse_args()
  tokens = list(range(1, 10))
  if args.child:
    print(json.dumps(measure(args.layers, tokens, args.repeats, args.cache_len)))
    return
  from specjax.records import command, save

  results = {"command": command(), "layers": args.layers, "cache_len": args.cache_len,
             "variants": {}}
  for name in args.variants.split(","):
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + VARIANTS[name]).strip())
    run = subprocess.run([sys.executable, __file__, "--child", name, "--layers", str(args.layers),
                          "--repeats", str(args.repeats), "--cache-len", str(args.cache_len)],
                         env=env, capture_output=True, text=True)
    if run.returncode:
      results["variants"][name] = {"flags": VARIANTS[name], "error": run.stderr[-2000:]}
      print(f"{name}: failed\n{run.stderr[-2000:]}", flush=True)
      continue
    seconds = {int(t): s for t, s in json.loads(run.stdout.strip().splitlines()[-1]).items()}
    ratio = {t: s / seconds[1] for t, s in seconds.items()}
    results["variants"][name] = {"flags": VARIANTS[name], "seconds": seconds, "ratio_to_T1": ratio}
    print(f"{name:10s} T=1 {seconds[1] * 1e3:7.1f} ms  ratios " +
          " ".join(f"{t}:{r:.2f}" for t, r in ratio.items()), flush=True)
  if args.out:
    save(results, args.out)


if __name__ == "__main__":
  main()
