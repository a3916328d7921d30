"""specjax: exact speculative decoding for JAX/Flax language models.

    import specjax
    dec = specjax.Decoder(target="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct")
    out = dec.generate(["def quicksort(xs):"], max_new_tokens=64)

Shape letters, used as suffixes of array names throughout (`logits_BxTxV`: batch x tokens x vocabulary):
  B   rows of a batch                     T   tokens of one forward chunk (a prompt chunk, a verify block)
  S   cache or history positions          P   positions of the right-padded prompts
  L   transformer layers                  V   target vocabulary size (W: a drafter's, when it differs)
  D   model width (d_model)               F   features handed to a drafter (concatenated residual streams)
  H   attention heads (H_kv: key/value heads, D_h: width of one head)
  K   draft tokens per round (K1 = K + 1: a verify block with its pending token)
  N   nodes of a draft tree (N1 = N + 1 with the root), or the tokens of a restricted draft head
  R   branches (n-gram spines)            E   end-of-sequence ids
"""


def __getattr__(name: str):
  # Lazy: `import specjax.models` (loaders, the registry's CLI) should not import the whole engine.
  if name in ("Decoder", "Generation"):
    from specjax import api
    return getattr(api, name)
  raise AttributeError(f"module 'specjax' has no attribute {name!r}")


__all__ = ["Decoder", "Generation"]
