"""RoPE variants and real-size configs against `transformers`: `rope.inverse_frequencies` equals
`modeling_rope_utils` for each scaling type at the sizes of published models, and the configs of
Llama-3.2-1B, Qwen3-0.6B, Gemma-2-2B and Gemma-3-270M read as the parameter counts transformers builds."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specjax.models import rope
from specjax.models.hf import config_from_hf_dict

LLAMA_3_2_1B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
    "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
    "rope_scaling": {
        "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
        "rope_type": "llama3"
    }
}
QWEN3_0_6B = {
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": True
}
GEMMA_2_2B = {
    "model_type": "gemma2", "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0
}
GEMMA_3_270M = {
    "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
    "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "query_pre_attn_scalar": 256, "sliding_window": 512, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "max_position_embeddings": 32768
}


@pytest.mark.parametrize("hf", [LLAMA_3_2_1B, QWEN3_0_6B, GEMMA_2_2B, GEMMA_3_270M],
                         ids=["llama-3.2-1b", "qwen3-0.6b", "gemma-2-2b", "gemma-3-270m"])
def test_real_configs_count_transformers_parameters(hf):
  config = config_from_hf_dict(hf)
  with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf))
  assert config.num_params() == model.num_parameters()


def test_llama_3_2_config():
  config = config_from_hf_dict(LLAMA_3_2_1B)
  assert config.tie_embeddings and config.rope_theta == 500000.0
  assert config.rope_scaling == rope.RopeScaling("llama3", factor=32.0, original_max_positions=8192,
                                                 low_freq_factor=1.0, high_freq_factor=4.0)


SCALINGS = [  # (rope_parameters, head_dim, max_position_embeddings)
    ({"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}, 256, 131072),
    ({**LLAMA_3_2_1B["rope_scaling"], "rope_theta": 500000.0}, 64, 131072),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}, 128, 131072),
    ({
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "rope_theta": 1e4,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707
    }, 64, 163840),
    ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, 128, 4096),
]


@pytest.mark.parametrize("params, head_dim, max_positions", SCALINGS,
                         ids=["linear", "llama3", "yarn", "yarn-mscale", "dynamic"])
def test_inverse_frequencies_equal_transformers(params, head_dim, max_positions):
  hf = {
      "model_type": "llama", "vocab_size": 8, "hidden_size": head_dim * 4, "num_hidden_layers": 1,
      "num_attention_heads": 4, "head_dim": head_dim, "intermediate_size": 8, "max_position_embeddings": max_positions,
      "rope_parameters": params
  }
  config = config_from_hf_dict(hf)
  hf_config = transformers.LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"})
  for seq_len in (None, 3 * max_positions):  # dynamic: within, then past the original context
    want, want_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, seq_len=seq_len)
    position = max_positions - 1 if seq_len is None else seq_len - 1
    got, got_factor = rope.inverse_frequencies(config.rope_scaling, config.rope_theta, head_dim,
                                               jnp.full((1, 1), position, jnp.int32))
    np.testing.assert_allclose(np.asarray(got).reshape(-1), want.numpy(), rtol=2e-6, atol=0)
    np.testing.assert_allclose(got_factor, want_factor, rtol=1e-6)
