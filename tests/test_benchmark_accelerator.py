"""`experiments.benchmark_accelerator`, the accelerator run kit, dry-run on CPU: its `tiny` config end to end
through the CLI (random tiny models, float32, 2 prompt lengths x batch 2 x (autoregressive, K = 2, adaptive
K <= 3; parallel and DFlash block cells at the first prompt length)), the
real-weights path on tiny HF directories, the deadline, config errors, and the constants the kit
hard-codes (the Qwen pair's shapes, the CPU acceptance rates it models speedups at)."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from configs.benchmarks import accelerator
from experiments import benchmark_accelerator as kit
from specjax.errors import ConfigError
from specjax.models import registry
from tests.helpers.tiny_hf import make_hf_model, save_char_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")

# The tiny variant's cells: per prompt length autoregressive, K = 2, adaptive K <= 3; the block drafters at the first.
GRID = [(p, mode, k) for p in (8, 20) for mode, k in (("autoregressive", None), ("speculative", 2), ("adaptive", 3),
                                                      *((("parallel", 2), ("dflash", 2)) if p == 8 else ()))]


def leviathan(alpha: float, k: int, c: float) -> float:
  return (1 - alpha**(k + 1)) / ((1 - alpha) * (k * c + 1))


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
  """One CLI run of the tiny config: (results, stdout)."""
  output = str(tmp_path_factory.mktemp("results") / "accelerator.json")
  command = [
      sys.executable, "-m", "experiments.benchmark_accelerator", "--config=configs/benchmarks/accelerator.py:tiny",
      f"--config.output={output}"
  ]
  # It inherits the test run's XLA_FLAGS (unoptimised code compiles faster): this test checks records and
  # exactness, not speed.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  with open(output) as f:
    return json.load(f), done.stdout


@pytest.mark.slow
def test_dry_run_records_every_cell_with_timings_and_models(dry_run):
  results, stdout = dry_run
  cfg = accelerator.get_config("tiny")
  assert results["command"].startswith("python -m experiments.benchmark_accelerator "
                                       "--config=configs/benchmarks/accelerator.py:tiny")
  assert ROOT not in json.dumps(results)  # no path of this machine's checkout
  for field in ("jax", "flax", "backend", "devices", "device_kind"):
    assert results["environment"][field], field
  assert results["finished"] and results["skipped"] == []
  assert results["models"]["target"]["n_layers"] == kit.SHAPES["tiny"][0].n_layers
  assert [(r["prompt_tokens"], r["mode"], r["k"]) for r in results["cells"]] == GRID
  for row in results["cells"]:
    if row["mode"] in kit.BLOCK_DRAFTERS:  # one draft pass per round
      assert row["draft_calls"] == row["target_calls_after_prefill"] and row["greedy_equals_autoregressive"]
  adaptive = [row for row in results["cells"] if row["mode"] == "adaptive"]
  for row in adaptive:  # the cost table measured on the device, with the cell's own program
    assert row["k_policy"]["lengths"] == [0, 1, 2, 3] and all(c > 0 for c in row["k_policy"]["cost_table_s"])
    assert sum(row["k_policy"]["rounds_per_length"]) == row["target_calls_after_prefill"]
  assert [(c["prompt_tokens"], c["batch_size"]) for c in results["costs"]] == [(8, 2), (20, 2)]
  # Verify widths: timed at the first prompt length only, each width once, as multiples of the 1-token step.
  (verify,) = results["verify_costs"]
  assert (verify["prompt_tokens"], verify["batch_size"]) == (8, 2)
  assert list(verify["seconds"]) == [str(t) for t in cfg.verify_widths] and min(verify["seconds"].values()) > 0
  for width, steps in verify["in_target_steps"].items():
    assert steps == pytest.approx(verify["seconds"][width] / verify["seconds"]["1"])
  assert "| 8 | 2 | 1.00 |" in stdout
  target, draft = kit.SHAPES["tiny"]
  for row in results["cells"]:
    assert row["batch_size"] == 2 and row["generated_tokens"] == 2 * cfg.max_new_tokens
    assert row["compile_time_s"] > 0 and row["warmup_s"] > 0 and len(row["wall_s_runs"]) == 2
    # prefill_s and wall_s are separate timings (a 1-token call, a full one): on the tiny models a noisy
    # machine can make the first exceed the second, so only their signs and the mean are checked.
    assert row["prefill_s"] > 0 and row["wall_s"] > 0
    assert row["wall_s"] == pytest.approx(sum(row["wall_s_runs"]) / 2)
    assert row["memory"] and all("peak_bytes_in_use" in m for m in row["memory"])
    kv_bytes = 2 * 2 * row["cache_len"] * 2 * 16 * 4  # 2 (k, v) x B x S x G x Dh x float32, per layer
    assert row["kv_cache_bytes"] == kv_bytes * (target.n_layers + (draft.n_layers if row["k"] else 0))
    if row["mode"] == "autoregressive":
      assert row["tokens_per_second"] > 0 and row["decode_tokens_per_second"] > 0
      assert row["target_calls_after_prefill"] == cfg.max_new_tokens - 1
      assert row["step_s"] == pytest.approx(row["decode_s"] / row["target_calls_after_prefill"])
  assert kit.table(results) in stdout
  # First, the attention comparison: the kernel (interpret mode on CPU), both modes, with their reports.
  ar, spec = results["attention_comparison"]
  assert (ar["attention"], ar["mode"], spec["mode"], spec["k"]) == ("kernel_interpret", "autoregressive", "speculative",
                                                                    cfg.comparison_k)
  assert spec["greedy_equals_autoregressive"] is True
  assert spec["round_in_target_steps"] == pytest.approx(spec["round_s"] / ar["step_s"])
  assert {"while_loops_in_round", "custom_calls"} <= set(ar["lowering"]) \
      and spec["lowering"]["while_loops_in_round"] >= 1
  assert "| kernel_interpret | speculative | 2 |" in stdout


@pytest.mark.slow
def test_speculative_cells_are_exact_and_model_speedups_by_the_formula(dry_run):
  results, _ = dry_run
  cfg = accelerator.get_config("tiny")
  baseline = {}
  for row in results["cells"]:
    if row["mode"] == "autoregressive":
      baseline = row
      continue
    assert row["greedy_equals_autoregressive"] is True and row["rows_equal_autoregressive"] == 2
    c = next(cost["cost_ratio_c"] for cost in results["costs"] if cost["prompt_tokens"] == row["prompt_tokens"])
    assert row["cost_ratio_c"] == c > 0
    assert row["round_s"] > 0 and row["round_in_target_steps"] == pytest.approx(row["round_s"] / baseline["step_s"])
    if row["mode"] != "speculative":  # adaptive (lengths vary) and block cells: no model of the draft applies
      assert row["modelled_speedup"] == {}
      if row["mode"] in kit.BLOCK_DRAFTERS:
        continue
      # Random weights accept nothing: the learned prior falls and plain rounds, which skip the draft on
      # this CPU, take over (a draft pass only in rounds that proposed something).
      proposing = sum(row["k_policy"]["rounds_per_length"][1:])
      assert (row["draft_calls"] > 0) == (proposing > 0) and row["k_policy"]["acceptance_learned"][0] < 0.5
      continue
    assert row["draft_calls"] > 0
    # Random weights: acceptance and measured throughput are not recorded, only modelled speedups.
    assert not {"alpha_hat", "tokens_per_second", "speedup"} & set(row)
    assert set(row["modelled_speedup"]) == set(cfg.modelled_alphas)
    for name, alpha in cfg.modelled_alphas.items():
      model, k = row["modelled_speedup"][name], row["k"]
      assert model["alpha"] == alpha
      assert model["leviathan"] == pytest.approx(leviathan(alpha, k, c))
      tokens_per_round = (1 - alpha**(k + 1)) / (1 - alpha)
      assert model["round_time"] == pytest.approx(tokens_per_round * baseline["step_s"] / row["round_s"])


@pytest.mark.slow
def test_real_weights_measure_acceptance_and_speedup(tmp_path):
  """weights=real on tiny HF directories (two different random models: drafts get rejected) and
  standard-library prompts through their character tokenizer. The grid alone: the attention comparison
  and the verify widths, which do not depend on where the weights came from, run in the dry run."""
  for name, seed in (("target", 0), ("draft", 1)):
    make_hf_model("qwen2", seed).save_pretrained(tmp_path / name)
    save_char_tokenizer(str(tmp_path / name))
  cfg = accelerator.get_config("tiny")
  cfg.update(weights="real", target=str(tmp_path / "target"), draft=str(tmp_path / "draft"), prompt_lengths=(24,),
             ks=(2,), adaptive_ks=(), block_drafters=(), attention_comparison=(), verify_widths=(), repeats=1,
             output=str(tmp_path / "real.json"))
  results = kit.run(cfg, log=lambda message: None)
  assert results["prompt_source"] == "standard-library sources" and results["finished"]
  baseline, spec = results["cells"]
  assert spec["greedy_equals_autoregressive"] is True
  assert 0 <= spec["alpha_hat"] <= 1 and 1 <= spec["mean_accepted_length"] <= 3
  assert spec["decode_speedup"] == pytest.approx(spec["decode_tokens_per_second"] /
                                                 baseline["decode_tokens_per_second"])
  measured = spec["modelled_speedup"]["measured_alpha"]
  assert measured["leviathan"] == pytest.approx(leviathan(spec["alpha_hat"], 2, spec["cost_ratio_c"]))
  with open(cfg.output) as f:
    assert json.load(f)["cells"] == json.loads(json.dumps(results["cells"]))


def test_cells_past_the_deadline_are_skipped_and_reported(tmp_path, capsys):
  cfg = accelerator.get_config("tiny")
  cfg.update(deadline_s=0.0, output=str(tmp_path / "late.json"))
  results = kit.run(cfg, log=lambda message: None)
  assert results["cells"] == [] and not results["finished"]
  assert [(s["prompt_tokens"], s["mode"], s["k"]) for s in results["skipped"]
         ] == [(8, "autoregressive", None), (8, "speculative", 2)] + GRID  # the attention comparison, then the grid
  assert all(s["reason"].startswith("deadline_s 0 passed") for s in results["skipped"])
  report = accelerator.get_config("tiny")
  report.report = cfg.output
  kit.main(report)
  assert capsys.readouterr().out.count("skipped: deadline_s 0 passed") == 2 + len(GRID)


def test_the_mtbench_cell_runs_the_kits_pair_or_says_why_not(tmp_path, capsys):
  cfg = accelerator.get_config("mtbench")
  cfg.update(output=str(tmp_path / "kit.json"))
  mt = kit.mtbench_config(cfg)
  assert (mt.target, mt.draft, mt.dtype) == (cfg.target, cfg.draft, "bfloat16")
  assert (mt.output, mt.figure) == (str(tmp_path / "kit_mtbench.json"), str(tmp_path / "kit_mtbench.png"))
  assert mt.batch_sizes == (1, 8) and mt.temperatures == (0.0, 1.0) and not mt.transformers
  tiny = accelerator.get_config("tiny")
  tiny.update(mtbench=True, deadline_s=0.0, output=str(tmp_path / "random.json"))
  results = kit.run(tiny, log=lambda message: None)
  assert results["mtbench"] == {"skipped": "weights=random: MT-Bench needs the real pair and its tokenizer"}
  assert not results["finished"]
  print(kit.table(results))
  assert "MT-Bench cell: skipped (weights=random" in capsys.readouterr().out


@pytest.mark.parametrize("field, value, message", [("weights", "fake", "config.weights"),
                                                   ("shapes", "gpt-5", "config.shapes"), ("ks", (), "config.ks"),
                                                   ("adaptive_ks", (0,), "config.adaptive_ks"),
                                                   ("batch_sizes", (0,), "config.batch_sizes"),
                                                   ("max_new_tokens", 1, "config.max_new_tokens"),
                                                   ("scan_layers", "yes", "config.scan_layers"),
                                                   ("verify_widths", (5, 9), "config.verify_widths"),
                                                   ("verify_widths", (1, 0), "config.verify_widths"),
                                                   ("attention_comparison", ("flash",), "config.attention"),
                                                   ("narrow_passes", "maybe", "config.narrow_passes"),
                                                   ("comparison_k", 0, "config.comparison_k")])
def test_bad_config_values_fail_naming_the_field(field, value, message):
  cfg = accelerator.get_config("tiny")
  cfg[field] = value
  with pytest.raises(ConfigError, match=message):
    kit.check(cfg)


def test_modelled_alphas_are_the_committed_cpu_measurements():
  alphas = accelerator.get_config().modelled_alphas
  with open(os.path.join(RESULTS, "decode_cpu_float32.json")) as f:
    runs = json.load(f)["specjax"]["runs"]
  chat = next(
      r["alpha_hat"]
      for r in runs
      if r["system"] == "specjax_speculative" and r["batch_size"] == 1 and r["k"] == 5 and r["draft_vocab"] == 0)
  with open(os.path.join(RESULTS, "drafters_cpu_float32_part2.json")) as f:
    rows = json.load(f)["runs"]
  raw = next(r["alpha_hat"] for r in rows if r["group"] == "raw/greedy" and r["system"] == "model_k5")
  assert (alphas.chat_code, alphas.raw_code) == (round(chat, 3), round(raw, 3))


@pytest.mark.parametrize("index, name", [(0, "qwen2.5-coder-1.5b-instruct"), (1, "qwen2.5-coder-0.5b-instruct")])
def test_random_shapes_equal_the_converted_qwen_models(index, name):
  """The hard-coded shapes against the config specjax stored when it converted the registry GGUF."""
  spec = registry.get_spec(name)
  params_file = os.path.join(registry.cache_dir(), "converted", spec.sha256[:32], "params.safetensors")
  if not os.path.isfile(params_file):
    pytest.skip(f"{name} has not been loaded on this machine (no {params_file})")
  with open(params_file, "rb") as f:
    header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
  stored = json.loads(header["__metadata__"]["config"])
  shapes = kit.SHAPES["qwen2.5-coder"][index]
  # As the cache stores them: nested dataclasses (rope_scaling) as dicts, tuples as lists.
  as_json = lambda v: json.loads(json.dumps(dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v))
  assert {field: as_json(getattr(shapes, field)) for field in stored if field != "dtype"
         } == {field: value for field, value in stored.items() if field != "dtype"}
