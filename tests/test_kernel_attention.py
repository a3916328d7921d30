"""The attention kernel path (`kernel_attention`: JAX's Pallas GPU decode kernel for the shared prefix,
the rest dense, merged), run in Pallas interpret mode on CPU.

Against the dense reference: ragged rows (an empty cache, a row whose chunk ends at the capacity), one
query or a K + 1 block, sliding windows narrower and wider than the chunk (static, and traced as under
`scan_layers`), a static tree, a tree level after earlier ones, per-row trees, float32 and bfloat16;
with huge keys and values in every slot no query may see, so that a part reading past its slots (the
kernel's range, the window's edge, the chunk) would show. End to end: greedy decoding of tiny HF
checkpoints equals `transformers` with the kernel on (Gemma 3: sliding and global layers; Gemma 2: its
soft-capped layers fall back to blockwise), and speculative decoding (chain, static tree, narrow passes
off) equals the target's own greedy decoding; chunked prefill through the kernel equals one dense pass.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.generation import as_token_lists, pad_prompts
from specjax.models import attention, kernel_attention
from specjax.models.attention_mask import Mask
from specjax.models.hf import load_hf_dir
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import prefill
from specjax.speculative.trees import tree as tree_lib
from specjax.speculative.trees.dynamic import DynamicTree
from tests.helpers.engine import DRAFTS, PROMPTS, TARGET, run_speculative, target_greedy, tiny_model
from tests.helpers.tiny_hf import assert_greedy_matches_generate, save_hf_model
from tests.helpers.trees import TREES, run_tree_speculative

B, G, HG, DH = 3, 2, 2, 16
BRANCHING = tree_lib.from_branching((2, 2, 1))  # 10 nodes with the root


def _per_row_tree(seed: int, nodes: int) -> DynamicTree:
  """One random tree per row: each node the first child of the previous one or its next sibling."""
  rng = np.random.default_rng(seed)
  parent, depth = np.full((B, nodes), -1), np.zeros((B, nodes), int)
  for b in range(B):
    for i in range(1, nodes):
      parent[b, i] = i - 1 if i == 1 or rng.random() < 0.5 else parent[b, i - 1]
      depth[b, i] = depth[b, parent[b, i]] + 1
  return DynamicTree(parent=jnp.asarray(parent, jnp.int32), depth=jnp.asarray(depth, jnp.int32),
                     max_depth=int(depth.max()), max_children=nodes)


CASES = {  # T, S, window, tree, dtype
    "decode": (1, 48, 0, None, "float32"),
    "verify": (6, 64, 0, None, "float32"),
    "verify_bf16": (6, 64, 0, None, "bfloat16"),
    "window_narrower_than_chunk": (6, 64, 3, None, "float32"),
    "window": (6, 64, 20, None, "float32"),
    "tree_window": (BRANCHING.nodes_with_root, 64, 7, BRANCHING, "float32"),
    "tree_level": (4, 64, 5, tree_lib.TreeLevel(BRANCHING, 3, 4), "float32"),
    "per_row_tree": (7, 48, 0, _per_row_tree(1, 7), "float32"),
}


def _inputs(seed, T, S, width, window, dtype):
  """q, a 2-layer cache (attended at layer 1), ragged lengths (0 and a chunk ending at S among them),
  and the same cache with 1e4 in every slot of layer 1 that no query sees."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  q, k, v = normal(B, T, G, HG, DH), normal(2, B, S, G, DH), normal(2, B, S, G, DH)
  lengths = np.array([0, S - width, rng.integers(window + 2, S - width)])
  slot_BxS = np.arange(S)[None, :]
  hidden_BxS = (slot_BxS >= lengths[:, None] + width) | (window > 0) & (slot_BxS <= lengths[:, None] - window)
  poison = lambda x: x.at[1].set(jnp.where(hidden_BxS[:, :, None, None], jnp.asarray(1e4, dtype), x[1]))
  return q, k, v, poison(k), poison(v), jnp.asarray(lengths, jnp.int32)


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_equals_dense(case):
  T, S, window, tree, dtype = CASES[case]
  width = T + (0 if tree is None else tree.first)
  q, k, v, poisoned_k, poisoned_v, lengths_B = _inputs(0, T, S, width, window, dtype)
  expected = attention.dense(q, k, v, 1, Mask(lengths_B, window, tree))
  got = jax.jit(lambda q, k, v, lengths_B: kernel_attention.kernel(q, k, v, 1, Mask(lengths_B, window, tree), interpret=
                                                                   True))(q, poisoned_k, poisoned_v, lengths_B)
  tolerance = 1e-5 if dtype == "float32" else 2e-2
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), rtol=tolerance,
                             atol=tolerance)


def test_traced_windows_per_layer():
  """Windows looked up by a traced layer index (Gemma's sliding and global layers under `scan_layers`)."""
  T, S = 4, 48
  windows = jnp.asarray([5, 0], jnp.int32)
  q, k, v, _, _, lengths_B = _inputs(2, T, S, T, 5, "float32")
  run = jax.jit(lambda layer: kernel_attention.kernel(q, k, v, layer, Mask(lengths_B, windows[layer]), interpret=True))
  for layer in (0, 1):
    expected = attention.dense(q, k, v, layer, Mask(lengths_B, int(windows[layer])))
    np.testing.assert_allclose(run(jnp.int32(layer)), expected, rtol=1e-5, atol=1e-5)


def test_tiling_covers_the_cache_in_whole_tiles():
  assert kernel_attention.tiling(48) == (1, 16) and kernel_attention.tiling(4096) == (16, 128)
  assert kernel_attention.tiling(96) == (2, 16) and kernel_attention.tiling(512) == (16, 32)
  with pytest.raises(ValueError, match="multiple of 16"):
    kernel_attention.tiling(40)
  config = TARGET[0].replace(attention="kernel_interpret")
  assert init_cache(config, 1, 40).max_len == 48 and init_cache(TARGET[0], 1, 40).max_len == 40


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_greedy_with_the_kernel_matches_transformers_generate(family, tmp_path):
  """Gemma 3's sliding (window 6) and global layers through the kernel; Gemma 2's soft-capped layers
  fall back to blockwise. Prompts past the window, ragged."""
  hf_model = save_hf_model(family, str(tmp_path))
  config, params = load_hf_dir(str(tmp_path))
  assert_greedy_matches_generate(hf_model, config.replace(attention="kernel_interpret"), params, 10)


def _kernel(model):
  config, params = model
  return config.replace(attention="kernel_interpret", narrow_passes=False), params


def test_speculative_greedy_with_the_kernel_equals_the_target():
  target = _kernel(TARGET)
  expected = target_greedy()
  chain = run_speculative(_kernel(DRAFTS["perturbed"]), target=target)
  assert as_token_lists(chain.tokens, chain.counts) == expected
  tree = run_tree_speculative(_kernel(DRAFTS["perturbed"]), TREES["branching"], target=target)
  assert as_token_lists(tree.tokens, tree.counts) == expected


def test_chunked_prefill_with_the_kernel_equals_one_dense_pass():
  """Prompt chunks of 4 through the kernel (each chunk's prefix in the kernel, the chunk dense): the
  logits and cache of one dense pass over the whole prompts."""
  config, params = tiny_model(0, n_layers=2)
  padded, lengths = pad_prompts(PROMPTS)
  run = lambda cfg: jax.jit(prefill, static_argnums=0)(cfg, params, padded, lengths, init_cache(cfg, len(PROMPTS), 32))
  want_logits, want_cache = run(config.replace(prefill_chunk=padded.shape[1], attention="dense"))
  logits, cache = run(config.replace(prefill_chunk=4, attention="kernel_interpret"))
  np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
  for b, n in enumerate(lengths):
    np.testing.assert_allclose(cache.k[:, b, :n], want_cache.k[:, b, :n], rtol=1e-5, atol=1e-5)
