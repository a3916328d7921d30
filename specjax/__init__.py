"""specjax: exact speculative decoding for JAX/Flax language models.

    import specjax
    dec = specjax.Decoder(target="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct")
    out = dec.generate(["def quicksort(xs):"], max_new_tokens=64)
    out = dec.generate([specjax.Request("Maria is 34. As JSON:", constraint={"json_schema": {"type": "object"}})])

Shape letters, used as suffixes of array names throughout (`logits_BxTxV`: batch x tokens x vocabulary;
a leading `x`, as in `probs_xV`, stands for any leading axes). Each letter or letter group means one thing:
  B   rows of a batch                     T   tokens of one chunk (a prompt chunk, a verify block, a sequence)
  S   cache or history positions          P   positions of the right-padded prompts (Pc: their chunks)
  L   transformer layers                  O   positions of a row's output buffer
  V   target vocabulary size              W   a drafter's vocabulary, when it differs from the target's
  Vd  the tokens a restricted draft head scores (Vs: one device's shard of V)
  D   model width (d_model; 2D = 2 x D)   Din, Dout   input and output width of one dense layer
  Dff hidden width of the MLP             F   features handed to a drafter (concatenated residual streams)
  H   query heads                         G   key/value heads (grouped-query attention: H = G x Hg)
  Hg  query heads per key/value head      Dh  width of one head
  Fq  RoPE frequencies (Dh / 2)           Sb  cache positions of one key block (blockwise attention)
  K   draft tokens per round (K1 = K + 1: a verify block with its pending token)
  N   draft nodes of a tree (N1 = N + 1 with the root)
  Dt  depth of a tree: the most draft tokens a round accepts (Dt1 = Dt + 1: a path with its root)
  Lv  nodes of one level of a tree        C   candidates: a node's children, a level's, top-k's
  Rk  ranks of the drawn candidates       b   children per expanded node of a dynamic tree
  Fr  fed frontier slots of a dynamic tree
  M   cache slots moved by a compaction   E   end-of-sequence ids
  R   branches (n-gram spines)            J   training-time-test steps (EAGLE-3)
  SJ  S then J keys, concatenated         ShC the C best of each of Sh vocabulary shards
  Z   rows of folded leading axes, or independent samples (z: one device's share of them)
  Rd  rounds of a recorded run            Col, U   key columns and the unique keys among rows (tests)
  A   the K policy's acceptance estimates per depth (a tree's whole cut, and its spine)
  Pl  tokens of the suffix drafter's pool Cp  tokens of a corpus the suffix drafter scans
  Mt  the context's last tokens a suffix match compares (max_match)   Oc  a match's occurrences
  a number: an axis of that static size
"""


def __getattr__(name: str):
  # Lazy: `import specjax.models` (loaders, the registry's CLI) should not import the whole engine.
  if name in ("Decoder", "Generation"):
    from specjax import api
    return getattr(api, name)
  if name == "Request":
    from specjax import prompts
    return prompts.Request
  raise AttributeError(f"module 'specjax' has no attribute {name!r}")


__all__ = ["Decoder", "Generation", "Request"]
