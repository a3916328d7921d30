"""Self-speculation on the Qwen2.5-Coder-1.5B-Instruct target: it drafts with 21 of its 28 layers, the
set found by experiments/layer_skip_search.py (alpha_hat 0.87 on its calibration prompts, K = 4). No
draft model, no second cache. On a 2-core CPU this is slower than decoding without drafts (a draft pass
costs 0.78 of a target step and a 5-token verify ~3 steps: see experiments/README.md); the set is meant
for accelerators, where verify costs about one step. Fields: specjax/decode_config.py."""

from configs import qwen_coder


def get_config():
  cfg = qwen_coder.get_config()
  cfg.drafter = "layer_skip"
  cfg.draft = ""  # no draft model
  cfg.layer_skip.layers = "0-5,7-8,10-11,14,16-17,19-20,22-27"
  cfg.k = 4
  return cfg
