"""Decoding on a device mesh (8 simulated CPU devices, in a subprocess: `tests/helpers/mesh_worker.py`).

Tokens on meshes (1,8), (2,4) and (8,1) equal the single-device tokens (greedy, speculative and
autoregressive; sampled with a fixed seed on (2,4), and across two processes); every weight is split as
the rules say and a device holds about 1/model of the bytes; the compiled speculative program moves no
weight, cache or full-vocabulary array between devices (the same inspection flags programs that do); bad
meshes fail with a clear message.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys

import pytest

from specjax import mesh as meshes
from tests.helpers.cli import cli_config, run_cli
from tests.helpers.cli import model_dirs  # noqa: F401 (the fixture)
from tests.helpers.multidevice import run_worker

WORKER = os.path.join(os.path.dirname(__file__), "helpers", "mesh_worker.py")


@functools.lru_cache(maxsize=None)
def _checks() -> dict:
  """The slow checks in one worker process: `hlo` inspects the programs `decode` compiled (no second
  compile of them) and the process starts once."""
  return run_worker("mesh_worker.py", "decode", "params", "hlo")


def _worker(check: str) -> dict:
  """One check's results (`errors`, the one fast check, in a process of its own: it runs no decode)."""
  return run_worker("mesh_worker.py", check)[check] if check == "errors" else _checks()[check]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["speculative", "autoregressive"])
@pytest.mark.parametrize("mesh", ["model=8", "data=2,model=4", "data=8"])
def test_greedy_tokens_on_a_mesh_equal_the_single_device_tokens(mesh, mode):
  results = _worker("decode")
  assert results[f"{mesh}|{mode}|greedy"] == results[f"|{mode}|greedy"]


@pytest.mark.slow
def test_sampled_tokens_on_a_mesh_equal_the_single_device_tokens_with_the_same_seed():
  """Top-k and top-p on vocabulary-split logits (the per-shard top-k), the same keys: the same draws."""
  results = _worker("decode")
  assert results["data=2,model=4|speculative|sampled"] == results["|speculative|sampled"]


@pytest.mark.slow
def test_two_processes_on_one_global_mesh_give_the_single_device_tokens():
  """The multi-host path on one machine: two processes of 4 simulated devices each join through
  `mesh.initialize_distributed` (the coordinator variables of docs/devices.md's launch) and decode on the
  global data=2,model=4 mesh; each process gets every row's sampled tokens, equal to the single-device
  run's."""
  with socket.socket() as probe:
    probe.bind(("localhost", 0))
    port = probe.getsockname()[1]
  env = dict(os.environ, SPECJAX_TEST_DEVICES="4", JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2")
  running = [
      subprocess.Popen([sys.executable, WORKER, "processes"], env={**env, "JAX_PROCESS_ID": str(i)},
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)
  ]
  outputs = [process.communicate(timeout=600) for process in running]
  for process, (_, err) in zip(running, outputs):
    assert process.returncode == 0, err[-3000:]
  results = [json.loads(out.strip().splitlines()[-1])["processes"] for out, _ in outputs]
  single = _worker("decode")
  for index, result in enumerate(results):
    assert result["started"] and result["processes"] == 2 and result["devices"] == 8
    assert result["process"] == index and result["main"] == (index == 0)
    assert result["sampled"] == single["|speculative|sampled"]


@pytest.mark.slow
def test_speculative_and_autoregressive_runs_differ_where_they_should():
  """Guards the equality test against a worker that returns one constant: greedy speculative equals
  greedy autoregressive (exactness), sampled runs differ from greedy ones."""
  results = _worker("decode")
  assert results["|speculative|greedy"] == results["|autoregressive|greedy"]
  assert results["|speculative|sampled"] != results["|speculative|greedy"]


@pytest.mark.slow
def test_caches_split_rows_over_data_and_key_value_heads_over_model_when_they_divide():
  """[L, B, S, G, Dh] = [2, 8, 64, 4, 8]: G = 4 splits over model=4 but not model=8 (replicated)."""
  results = _worker("decode")
  assert results["data=2,model=4|cache_shard"] == [2, 4, 64, 1, 8]
  assert results["model=8|cache_shard"] == [2, 8, 64, 4, 8]
  assert results["data=8|cache_shard"] == [2, 1, 64, 4, 8]


@pytest.mark.slow
def test_every_large_weight_is_split_and_a_device_holds_a_model_axis_share():
  results = _worker("params")
  shards = results["data=2,model=4"]["shards"]
  assert shards["embed/embedding"] == [512 // 4, 64] and shards["lm_head/weight"] == [512 // 4, 64]
  assert shards["layers_0/attn/q_proj/weight"] == [8 * 8 // 4, 64]
  assert shards["layers_0/attn/k_proj/weight"] == [4 * 8 // 4, 64]
  assert shards["layers_0/attn/o_proj/weight"] == [64, 8 * 8 // 4]
  assert shards["layers_1/mlp/gate_proj/weight"] == [128 // 4, 64]
  assert shards["layers_1/mlp/down_proj/weight"] == [64, 128 // 4]
  assert shards["layers_0/attn_norm/scale"] == [64] and shards["final_norm/scale"] == [64]
  # model=8 keeps the 4 key/value heads whole (replicated), splits the rest 8 ways.
  assert results["model=8"]["shards"]["layers_0/attn/k_proj/weight"] == [32, 64]
  assert results["model=8"]["shards"]["layers_0/attn/q_proj/weight"] == [8, 64]
  for spec, model_axis in (("data=2,model=4", 4), ("model=8", 8)):
    per_device = results[spec]["bytes_per_device"]
    assert len(per_device) == 8
    total = results[spec]["total_bytes"]
    norms = 5 * 64 * 4  # 2 norms x 2 layers + the final norm, float32, on every device
    replicated_kv = (2 * 2 * 32 * 64 * 4) if model_axis == 8 else 0
    expected = (total - norms - replicated_kv) / model_axis + norms + replicated_kv
    for held in per_device.values():
      assert held == pytest.approx(expected, rel=1e-6)


def _large(found, smallest_weight, vocab):
  """The gathers / permutes (all-reduces of activations are the partitioned matmuls' own) that move a
  full-vocabulary axis or as many elements as the smallest split weight."""
  return [(op, shape)
          for op, shape in found
          if op != "all-reduce" and (vocab in shape or _elements(shape) >= smallest_weight)]


def _elements(shape):
  out = 1
  for d in shape:
    out *= d
  return out


@pytest.mark.slow
@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_the_compiled_program_gathers_no_weight_cache_or_vocabulary(sampling):
  """No all-gather / all-to-all / collective-permute in the speculative program (data=2,model=4)
  whose result has a full-vocabulary axis or as many elements as the smallest split weight (caches
  are larger still); the small ones left are per-row reductions and the top-k survivors."""
  results = _worker("hlo")
  assert any(op == "all-reduce" for op, _ in results[sampling]), "the program is not partitioned"
  assert _large(results[sampling], results["smallest_sharded_weight"], results["vocab"]) == []


@pytest.mark.slow
def test_the_inspection_flags_programs_that_gather_the_vocabulary():
  results = _worker("hlo")
  assert _large(results["control"], results["smallest_sharded_weight"], results["vocab"])


def test_bad_meshes_fail_with_a_message_naming_the_problem():
  results = _worker("errors")
  assert "has 4 devices (2 x 2), but 8 are present" in results["product"]["error"]
  assert "'tensor=4' is not AXIS=SIZE" in results["axis_name"]["error"]
  assert "target: its 12 query heads do not split over mesh axis 'model' of size 8" in results["heads"]["error"]
  assert "'heads': None" in results["heads_replicated"]["returned"]


@pytest.mark.parametrize("spec, devices, want", [("data=2,model=4", 8, (2, 4)), ("model=-1", 8, (1, 8)),
                                                 ("data=-1,model=2", 8, (4, 2)), ("data=8", 8, (8, 1)),
                                                 (" model = 2 , data = 1 ", 2, (1, 2))])
def test_mesh_strings_resolve_to_axis_sizes(spec, devices, want):
  assert meshes.axis_sizes(spec, devices) == want


@pytest.mark.parametrize("spec, message", [("data=2,data=4", "given twice"),
                                           ("data=-1,model=-1", "only one axis may be -1"),
                                           ("model=x", "is not an integer"), ("model=0", "sizes are >= 1"),
                                           ("data=3,model=-1", "do not split"), ("model", "is not AXIS=SIZE")])
def test_bad_mesh_strings_name_the_bad_part(spec, message):
  with pytest.raises(ValueError, match=message):
    meshes.axis_sizes(spec, 8)


@pytest.mark.slow
def test_the_decode_cli_on_a_mesh_writes_the_single_device_tokens_and_the_devices(model_dirs, tmp_path):
  """`python -m specjax.decode --config.mesh=data=2,model=4` on 8 simulated devices: the tiny models'
  97 vocabulary rows do not split over 4 (one clear line, exit status 1) unless they are replicated;
  then the tokens equal the single-device run's and the results record the mesh and bytes per device.
  A batch that does not split over the data axis is refused before any model loads (status 2)."""
  from specjax import pipeline

  base = [
      "--config=configs/tiny.py", f"--config.target={model_dirs[0]}", f"--config.draft={model_dirs[1]}",
      "--config.mesh=data=2,model=4"
  ]
  devices = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"}
  output = str(tmp_path / "mesh.json")
  ok = run_cli(base + ["--config.mesh_indivisible=replicate", f"--config.output={output}"], env=devices)
  refused = run_cli(base, env=devices)
  rows = run_cli(base[:-1] + ["--config.mesh=data=8", "--config.batch_size=2"], env=devices)
  _, refused_err = refused.communicate(timeout=600)
  _, rows_err = rows.communicate(timeout=600)
  assert rows.returncode == 2 and rows_err.strip().splitlines() == [
      "error: config.batch_size 2 does not split over the mesh's data axis of size 8: use a multiple of 8"
  ]
  _, ok_err = ok.communicate(timeout=600)
  assert ok.returncode == 0, ok_err[-2000:]
  assert refused.returncode == 1
  assert refused_err.strip().splitlines() == [
      "error: target: its 97 vocabulary rows do not split over mesh axis 'model' of size 4 (axis sizes up to 8 "
      "that divide them: [1]); choose another mesh, or keep them whole on every device (config.mesh_indivisible="
      "'replicate'; for a draft model also config.draft_sharding='replicated')"
  ]
  on_mesh = json.load(open(output))
  alone = pipeline.run(cli_config(model_dirs), log=lambda message: None)
  assert [o["token_ids"] for o in on_mesh["outputs"]] == [o["token_ids"] for o in alone["outputs"]]
  environment = on_mesh["environment"]
  assert environment["mesh"] == {"data": 2, "model": 4} and environment["device_count"] == 8
  assert environment["process_count"] == 1
  assert environment["target_param_bytes_per_device"] < alone["environment"]["target_param_bytes_per_device"]


def test_a_cache_laid_out_for_a_mesh_cannot_be_made_without_one():
  """Without the mesh set, the layout's constraints would silently do nothing (an unsharded cache)."""
  from specjax.models.config import ModelConfig
  from specjax.models.kv_cache import init_cache
  from specjax.partitioning import CacheSharding
  config = ModelConfig(arch="llama", vocab_size=8, d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=4, d_ff=8)
  with pytest.raises(ValueError, match="lays the cache out on a mesh, but none is set"):
    init_cache(config, 2, 8, CacheSharding((None, "data", None, "model", None)))
