"""EAGLE head interchange: specjax's layout round-trips; a tiny head written in EAGLE-3's released layout
loads with its tensors in the right places (its logits equal a numpy transcription of EAGLE-3's
forward); heads for another target fail with a clear message; `drafter = "eagle"` keeps greedy output
through the decode pipeline."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from configs import tiny
from specjax import pipeline
from specjax.errors import ConfigError
from specjax.models.kv_cache import init_cache
from specjax.models.load import load_model
from specjax.speculative.drafters.draft_head import restrict_head
from specjax.speculative.drafters.eagle_head import fuse, head_forward, head_logits
from specjax.speculative.drafters.eagle_io import WEIGHTS_FILE, load_head, save_head
from tests.helpers.eagle import eagle_head
from tests.helpers.layer_skip import TARGET
from tests.helpers.tiny_hf import save_char_tokenizer, save_hf_model


def _leaves(params):
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


@pytest.mark.parametrize("feature_layers, restricted", [((0, 1, 2), True), ((), False)])
def test_specjax_layout_round_trips(tmp_path, feature_layers, restricted):
  config, params = eagle_head(TARGET[0], feature_layers)
  vocab = restrict_head(*TARGET, [1, 4, 9, 30]) if restricted else None
  save_head(str(tmp_path), config, params, vocab)
  loaded_config, loaded_params, loaded_vocab = load_head(str(tmp_path), *TARGET)
  assert loaded_config == config
  expected, got = _leaves(params), _leaves(loaded_params)
  assert expected.keys() == got.keys()
  for name in expected:
    np.testing.assert_array_equal(got[name], expected[name])
  if restricted:
    np.testing.assert_array_equal(loaded_vocab.tokens_Vd, vocab.tokens_Vd)
    np.testing.assert_array_equal(loaded_vocab.weight_VdxD, vocab.weight_VdxD)
  else:
    assert loaded_vocab is None


def test_bfloat16_heads_take_half_the_bytes_and_load_their_rounded_weights(tmp_path):
  config, params = eagle_head(TARGET[0], (0, 1, 2))
  vocab = restrict_head(*TARGET, [1, 4, 9, 30])
  save_head(str(tmp_path / "f32"), config, params, vocab)
  save_head(str(tmp_path / "bf16"), config, params, vocab, dtype="bfloat16")
  size = lambda name: os.path.getsize(tmp_path / name / WEIGHTS_FILE)
  assert size("bf16") < 0.55 * size("f32")
  _, loaded, loaded_vocab = load_head(str(tmp_path / "bf16"), *TARGET)
  got = _leaves(loaded)
  for name, leaf in _leaves(params).items():
    np.testing.assert_array_equal(got[name], leaf.astype(ml_dtypes.bfloat16).astype(np.float32))
  np.testing.assert_array_equal(loaded_vocab.weight_VdxD, vocab.weight_VdxD)  # the target's rows, not rounded
  with pytest.raises(ValueError, match="float32, bfloat16"):
    save_head(str(tmp_path / "f16"), config, params, vocab, dtype="float16")


def test_heads_that_hold_their_vocabulary_rows_still_load_them(tmp_path):
  """Heads written before the rows were gathered at load time carry vocab/weight: it is used as stored."""
  config, params = eagle_head(TARGET[0], (0, 1, 2))
  vocab = restrict_head(*TARGET, [1, 4, 9, 30])
  save_head(str(tmp_path), config, params, vocab)
  from safetensors.numpy import load_file

  tensors = load_file(str(tmp_path / WEIGHTS_FILE))
  stored = 2 * np.asarray(vocab.weight_VdxD, np.float32)
  save_file({**tensors, "vocab/weight": stored}, str(tmp_path / WEIGHTS_FILE))
  _, _, loaded_vocab = load_head(str(tmp_path), *TARGET)
  np.testing.assert_array_equal(loaded_vocab.weight_VdxD, stored)


def test_heads_for_another_target_fail_to_load(tmp_path):
  config, params = eagle_head(TARGET[0], (0, 1, 2))
  save_head(str(tmp_path), config, params)
  with pytest.raises(ValueError, match=r"after target layers \[2\].*has 2 layers"):
    load_head(str(tmp_path), TARGET[0].replace(n_layers=2), TARGET[1])
  with pytest.raises(ValueError, match="wide, the target's d_model is 48"):
    load_head(str(tmp_path), TARGET[0].replace(d_model=48, head_dim=12), TARGET[1])
  with pytest.raises(FileNotFoundError, match="neither"):
    load_head(str(tmp_path / "missing"), *TARGET)


# A tiny EAGLE-3 head as the released ones are laid out, for a 9-layer target of width D = 32
# (features entering blocks 2, 4 and 6: after blocks 1, 3 and 5).
D, HEADS, KV_HEADS, HEAD_DIM, FF, N_DRAFT = 32, 4, 2, 8, 48, 6
EAGLE3_TARGET = TARGET[0].replace(n_layers=9)


def _write_eagle3(directory, rng):
  config = {
      "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": D, "intermediate_size": FF,
      "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_hidden_layers": 1,
      "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": EAGLE3_TARGET.vocab_size, "draft_vocab_size": N_DRAFT,
      "hidden_act": "silu"
  }
  normal = lambda *shape: rng.normal(0.0, 0.3, shape).astype(np.float32)
  tensors = {
      "fc.weight": normal(D, 3 * D),
      "norm.weight": 1 + normal(D),
      "midlayer.input_layernorm.weight": 1 + normal(D),
      "midlayer.hidden_norm.weight": 1 + normal(D),
      "midlayer.post_attention_layernorm.weight": 1 + normal(D),
      "midlayer.self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, 2 * D),
      "midlayer.self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, 2 * D),
      "midlayer.self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, 2 * D),
      "midlayer.self_attn.o_proj.weight": normal(D, HEADS * HEAD_DIM),
      "midlayer.mlp.gate_proj.weight": normal(FF, D),
      "midlayer.mlp.up_proj.weight": normal(FF, D),
      "midlayer.mlp.down_proj.weight": normal(D, FF),
      "lm_head.weight": normal(N_DRAFT, D),
      "d2t": np.asarray([0, 2, 5, 5, 9, 40], np.int64),  # draft ids 0..5 -> target ids 0, 3, 7, 8, 13, 45
      "t2d": np.zeros(EAGLE3_TARGET.vocab_size, bool),
  }
  save_file(tensors, os.path.join(directory, "model.safetensors"))
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f)
  return tensors


def _rms(x, weight, eps=1e-5):
  return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _eagle3_first_step(t, embed_D, features_3D):
  """EAGLE-3's forward (cnets.py) at the first position, where attention sees only itself: its output is
  o_proj(v_proj(x)) whatever q and k are. Returns the draft-vocabulary logits [Vd] and their target ids."""
  silu = lambda x: x / (1 + np.exp(-x))
  hidden = t["fc.weight"] @ features_3D
  x_2D = np.concatenate(
      [_rms(embed_D, t["midlayer.input_layernorm.weight"]),
       _rms(hidden, t["midlayer.hidden_norm.weight"])])
  values = (t["midlayer.self_attn.v_proj.weight"] @ x_2D).reshape(KV_HEADS, HEAD_DIM)
  attn = t["midlayer.self_attn.o_proj.weight"] @ np.repeat(values, HEADS // KV_HEADS, axis=0).ravel()
  h = hidden + attn
  y = _rms(h, t["midlayer.post_attention_layernorm.weight"])
  h = h + t["midlayer.mlp.down_proj.weight"] @ (silu(t["midlayer.mlp.gate_proj.weight"] @ y) *
                                                (t["midlayer.mlp.up_proj.weight"] @ y))
  return t["lm_head.weight"] @ _rms(h, t["norm.weight"]), np.arange(N_DRAFT) + t["d2t"]


def test_an_eagle3_head_in_its_released_layout_loads(tmp_path):
  rng = np.random.default_rng(0)
  tensors = _write_eagle3(str(tmp_path), rng)
  config, params, vocab = load_head(str(tmp_path), EAGLE3_TARGET, TARGET[1])
  assert config.feature_layers == (1, 3, 5)
  assert (config.block.n_heads, config.block.n_kv_heads, config.block.d_ff, config.block.norm_eps) == (HEADS, KV_HEADS,
                                                                                                       FF, 1e-5)
  embedding_VxD = jnp.asarray(rng.normal(0.0, 1.0, (EAGLE3_TARGET.vocab_size, D)), jnp.float32)
  features_3D = rng.normal(0.0, 1.0, 3 * D).astype(np.float32)
  token = 17
  out_1x1xD, _ = head_forward(config, params, embedding_VxD, jnp.asarray([[token]]),
                              fuse(config, params, jnp.asarray(features_3D))[None, None],
                              init_cache(config.block, 1, 4))
  logits_V = np.asarray(head_logits(config, params, EAGLE3_TARGET, None, vocab, out_1x1xD[0, 0]))
  expected_Vd, ids_Vd = _eagle3_first_step(tensors, np.asarray(embedding_VxD[token]), features_3D)
  np.testing.assert_allclose(logits_V[ids_Vd], expected_Vd, rtol=1e-4, atol=1e-4)
  assert np.all(np.isneginf(np.delete(logits_V, ids_Vd)))


def test_an_eagle3_head_for_another_width_fails(tmp_path):
  _write_eagle3(str(tmp_path), np.random.default_rng(0))
  with pytest.raises(ValueError, match="target of width 32, this target's d_model is 64"):
    load_head(str(tmp_path), EAGLE3_TARGET.replace(d_model=64, head_dim=16), TARGET[1])


def test_eagle_drafter_keeps_greedy_output_through_the_pipeline(tmp_path):
  target_dir, head_dir = str(tmp_path / "target"), str(tmp_path / "head")
  save_hf_model("qwen2", target_dir, seed=0)
  save_char_tokenizer(target_dir)
  save_head(head_dir, *eagle_head(load_model(target_dir).config, (0, 1)))
  cfg = tiny.get_config()
  cfg.update(target=target_dir, draft=head_dir, drafter="eagle", k=3)
  spec = pipeline.run(cfg, log=lambda m: None)
  cfg.update(mode="autoregressive", draft="")
  ar = pipeline.run(cfg, log=lambda m: None)
  assert [o["token_ids"] for o in spec["outputs"]] == [o["token_ids"] for o in ar["outputs"]]
  assert spec["stats"]["draft_calls"] > 0 and spec["stats"]["eagle_feature_layers"] == [0, 1]
  target = load_model(target_dir)
  save_head(head_dir, *eagle_head(target.config, (0, 1)), restrict_head(target.config, target.params, range(0, 40, 2)))
  cfg.update(mode="speculative", draft=head_dir)
  cfg.eagle.vocab = 8  # the head's own 20 tokens win, or it fails
  with pytest.raises(ConfigError, match="config.eagle.vocab 8: the head .* own restricted vocabulary of 20"):
    pipeline.run(cfg, log=lambda m: None)


def test_an_eagle3_head_missing_a_tensor_fails(tmp_path):
  tensors = _write_eagle3(str(tmp_path), np.random.default_rng(0))
  save_file({k: v for k, v in tensors.items() if k not in ("norm.weight", "lm_head.weight")},
            os.path.join(str(tmp_path), "model.safetensors"))
  with pytest.raises(ValueError, match=r"lacks \['norm.weight', 'lm_head.weight'\]"):
    load_head(str(tmp_path), EAGLE3_TARGET, TARGET[1])
