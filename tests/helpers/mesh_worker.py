"""Runs the multi-device checks in a process of its own with 8 simulated CPU devices (or
$SPECJAX_TEST_DEVICES) and prints one JSON object of results, {check: its results} for the checks named;
`tests/test_mesh.py` starts it (the rest of the suite keeps one device). `decode hlo` in one process
compiles the speculative programs once: `hlo` lowers the very programs `decode` ran.

  python tests/helpers/mesh_worker.py CHECK... (decode, params, hlo, errors, processes)
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=" +
                           os.environ.get("SPECJAX_TEST_DEVICES", "8"))
# The repository root first on the path, and this directory off it: its gguf.py and tokenizers.py would
# shadow those packages.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(os.path.dirname(_HERE))] + [p for p in sys.path if os.path.abspath(p) != _HERE]

import contextlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specjax import autoregressive, mesh as meshes, partitioning  # noqa: E402
from specjax.generation import Request  # noqa: E402
from specjax.models.config import ModelConfig  # noqa: E402
from specjax.models.kv_cache import init_cache  # noqa: E402
from specjax.models.transformer import init_params  # noqa: E402
from specjax.sampling import sampling_params  # noqa: E402
from specjax.speculative.drafters.model import ModelDrafter  # noqa: E402
from specjax.speculative.loop import SpeculativeLoop, speculative_generate  # noqa: E402

STARTED = meshes.initialize_distributed()  # before anything touches a device; False unless launched so

# Heads 8 and key/value heads 4: on model=8 the key/value heads are replicated, on model=4 split.
TARGET = ModelConfig(arch="llama", vocab_size=512, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8,
                     d_ff=128)
DRAFT = TARGET.replace(n_layers=1)
PROMPTS = np.array([[5, 17, 3, 44, 9, 1], [1, 2, 0, 0, 0, 0], [60, 1, 2, 3, 4, 5], [7, 7, 7, 0, 0, 0],
                    [300, 2, 9, 0, 0, 0], [11, 0, 0, 0, 0, 0], [4, 4, 500, 6, 0, 0], [100, 200, 300, 400, 1, 2]],
                   np.int32)  # 8 rows, ragged: one per device on data=8
LENGTHS = np.array([6, 2, 6, 3, 3, 1, 4, 6], np.int32)
CACHE = 64
MESHES = ("", "model=8", "data=2,model=4", "data=8")
# Few top-k candidates, so that the survivors of the vocabulary shards (4 x 8 per row) are far fewer
# than V (the gathers left in the program are those survivors and per-row reductions).
SAMPLED = sampling_params(1.0, top_k=8, top_p=0.9, candidates=8)


def _params(config: ModelConfig, seed: int):
  """Peaked random weights (numpy, std 0.3 on matrices) in the tree `init_params` defines."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: np.asarray(
          rng.normal(0.0, 0.3, leaf.shape)
          if leaf.ndim == 2 else np.full(leaf.shape, 1.0 if path[-1].key == "scale" else 0.0), np.float32), shapes)


def _placed(spec: str, seed_target: int = 0, seed_draft: int = 1):
  """(target params, drafter, target cache, part) laid out on mesh `spec` ("" = one device)."""
  mesh = meshes.make_mesh(spec)
  part = partitioning.Partitioning(mesh, name="target") if mesh else None
  target = partitioning.shard_params(TARGET, jax.tree.map(jnp.asarray, _params(TARGET, seed_target)), part)
  draft = partitioning.shard_params(DRAFT, jax.tree.map(jnp.asarray, _params(DRAFT, seed_draft)), part)
  drafter = ModelDrafter(DRAFT, draft, cache_sharding=partitioning.cache_sharding(DRAFT, part))
  return target, drafter, part, mesh


def _run(spec: str, mode: str, sampling, seed: int = 3, lower: bool = False):
  """(tokens, output) of a decode on mesh `spec`; with `lower`, the compiled text of the speculative
  program instead (the program such a run compiles: free in a process that ran it)."""
  target, drafter, part, mesh = _placed(spec)
  context = jax.set_mesh(mesh) if mesh else contextlib.nullcontext()
  with context:
    cache = init_cache(TARGET, len(PROMPTS), CACHE, partitioning.cache_sharding(TARGET, part))
    request = Request(PROMPTS, LENGTHS, 20, [-1], sampling, jax.random.key(seed))
    if mode == "autoregressive":
      out = autoregressive.generate(TARGET, target, request, cache)
    else:
      out = speculative_generate(SpeculativeLoop(TARGET, 3), target, drafter, request, cache,
                                 drafter.storage(len(PROMPTS), CACHE), lower=lower)
      if lower:
        return out.compile().as_text()
    return np.asarray(meshes.to_host(out.tokens)).tolist(), out


def decode() -> dict:
  """Tokens of every mesh, greedy speculative and autoregressive, and sampled speculative on one
  device and on data=2,model=4; the caches' layout."""
  results = {}
  for spec in MESHES:
    for mode in ("speculative", "autoregressive"):
      sampled = mode == "speculative" and spec in ("", "data=2,model=4")
      for name, sampling in (("greedy", sampling_params(0.0)),) + ((("sampled", SAMPLED),) if sampled else ()):
        tokens, out = _run(spec, mode, sampling)
        results[f"{spec}|{mode}|{name}"] = tokens
        if mode == "speculative" and name == "greedy" and spec:
          results[f"{spec}|cache_shard"] = list(out.target_cache.k.addressable_shards[0].data.shape)
  return results


def params() -> dict:
  """Per weight: the shape of its shard on device 0, and the bytes every device holds."""
  results = {}
  for spec in ("data=2,model=4", "model=8"):
    target, _, part, _ = _placed(spec)
    flat = jax.tree_util.tree_flatten_with_path(target)[0]
    results[spec] = {
        "shards": {"/".join(k.key for k in path): list(leaf.addressable_shards[0].data.shape) for path, leaf in flat},
        "bytes_per_device": partitioning.bytes_per_device(target),
        "total_bytes": sum(leaf.nbytes for leaf in jax.tree.leaves(target))
    }
  return results


def collectives(hlo_text: str) -> list[tuple[str, list[int]]]:
  """(op, result shape) of every collective (all-reduce, all-gather, all-to-all, collective-permute) of
  a compiled program (a tuple-shaped one by its first element)."""
  found = []
  for line in hlo_text.splitlines():
    match = re.search(
        r"= \(?[a-z0-9]+\[([0-9,]*)\][^=]*? (all-reduce|all-gather|all-to-all|"
        r"collective-permute)(-start)?\(", line)
    if match:
      found.append((match.group(2), [int(d) for d in match.group(1).split(",") if d]))
  return found


def hlo() -> dict:
  """The collectives of the compiled speculative programs on data=2,model=4 (greedy and sampled: those
  `decode` runs), and of a control that does gather a vocabulary-sharded array (XLA's top_k on it)."""
  results = {
      name: collectives(_run("data=2,model=4", "speculative", sampling, lower=True))
      for name, sampling in (("greedy", sampling_params(0.0)), ("sampled", SAMPLED))
  }
  target, _, part, mesh = _placed("data=2,model=4")
  with jax.set_mesh(mesh):
    logits = jax.device_put(jnp.ones((16, TARGET.vocab_size)), part.sharding("data", "model"))
    results["control"] = collectives(jax.jit(lambda x: jax.lax.top_k(x, 8)).lower(logits).compile().as_text())
  sharded = [leaf for leaf in jax.tree.leaves(target) if not leaf.sharding.is_fully_replicated]
  results["smallest_sharded_weight"] = min(leaf.size for leaf in sharded)
  results["vocab"] = TARGET.vocab_size
  return results


def errors() -> dict:
  """The message of each bad mesh input, raised before anything compiles."""
  cases = {
      "product": lambda: meshes.make_mesh("data=2,model=2"), "axis_name": lambda: meshes.make_mesh("data=2,tensor=4"),
      "heads": lambda: partitioning.Partitioning(meshes.make_mesh("model=8"), name="target").resolve(
          TARGET.replace(n_heads=12, n_kv_heads=4)),
      "heads_replicated": lambda: partitioning.Partitioning(meshes.make_mesh("model=8"), indivisible="replicate", name=
                                                            "target").resolve(TARGET.replace(n_heads=12, n_kv_heads=4))
  }
  results = {}
  for name, case in cases.items():
    try:
      results[name] = {"returned": str(case())}
    except ValueError as e:
      results[name] = {"error": str(e)}
  return results


def processes() -> dict:
  """One of several processes (the environment names the coordinator, `mesh.initialize_distributed`):
  sampled speculative tokens on the global data=2,model=4 mesh, gathered to every process."""
  return {
      "started": STARTED, "process": jax.process_index(), "processes": jax.process_count(),
      "devices": jax.device_count(), "main": meshes.is_main_process(),
      "sampled": _run("data=2,model=4", "speculative", SAMPLED)[0]
  }


if __name__ == "__main__":
  print(json.dumps({name: globals()[name]() for name in sys.argv[1:]}))
