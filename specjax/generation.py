"""What every generate loop shares: padded prompt batches, the per-row output buffer with its EOS and
budget bookkeeping, and the host-side checks that keep shapes legal before anything is compiled.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling import SamplingParams


@flax.struct.dataclass
class OutputBuffer:
  """Generated tokens per row; row b holds `counts[b]` valid tokens, the rest is garbage until
  `finalize` pads it."""

  tokens: jax.Array  # [B, O] int32: O = largest budget + widest chunk appended at once
  counts: jax.Array  # [B] int32: valid tokens per row
  done: jax.Array  # [B] bool: row hit an EOS token or its budget


@flax.struct.dataclass
class Request:
  """What a generate call decodes (runtime values: another request of the same shapes reuses the
  compiled program), as given or, once `ready`, as the jitted loop reads it."""

  prompts_BxP: Any  # [B, P] int32 right-padded prompts (`pad_prompts`)
  prompt_lengths_B: Any  # [B] int32
  max_new_tokens: Any  # int or [B]: each row's budget ([B] int32 once ready)
  eos_ids: Any  # int or [E]: ids that end a row ([E] int32 once ready)
  sampling: SamplingParams  # temperature, top-k, top-p (their static flags choose the program)
  key: jax.Array  # PRNG key
  round_limit: Any = None  # the speculative loop's most rounds, finished or not (None = no limit; calibration)

  def ready(self, budget_B: jax.Array) -> "Request":
    """The request as arrays, with the per-row budgets [B] `budgets` checked."""
    limit = np.iinfo(np.int32).max if self.round_limit is None else self.round_limit
    return self.replace(prompts_BxP=jnp.asarray(self.prompts_BxP, jnp.int32),
                        prompt_lengths_B=jnp.asarray(self.prompt_lengths_B, jnp.int32), max_new_tokens=budget_B,
                        eos_ids=jnp.asarray(self.eos_ids, jnp.int32).reshape(-1), round_limit=jnp.int32(limit))


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0, width: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded `[B, P]` int32 prompts and their `[B]` lengths; empty prompts are an error.

  P = `width` when given (>= the longest prompt), else the longest prompt. The prompt array's shape is
  static under jit: callers running several batches pass one width so they compile once."""
  if not prompts:
    raise ValueError("no prompts given")
  lengths = np.array([len(p) for p in prompts], np.int32)
  if lengths.min() < 1:
    raise ValueError(f"prompt {int(lengths.argmin())} is empty: every row needs at least one token")
  if width and width < lengths.max():
    raise ValueError(f"pad width {width} is shorter than the longest prompt ({int(lengths.max())})")
  padded = np.full((len(prompts), width or int(lengths.max())), pad_id, np.int32)
  for b, prompt in enumerate(prompts):
    padded[b, :len(prompt)] = prompt
  return padded, lengths


def check_fits(name: str, prompt_lengths: np.ndarray, max_new_tokens: int, slack: int, cache_len: int,
               limit: int = 0) -> None:
  """Raises unless the longest prompt + budget + the loop's look-ahead `slack` fits `cache_len`
  (and a learned position table of `limit` rows, when given). Checked on the host, before jit."""
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  need = int(np.max(prompt_lengths)) + max_new_tokens + slack
  if need > cache_len:
    raise ValueError(f"{name}: longest prompt ({int(np.max(prompt_lengths))} tokens) + max_new_tokens "
                     f"({max_new_tokens}) + look-ahead ({slack}) = {need} positions exceed the cache "
                     f"size {cache_len}; raise cache_len or shorten the prompt/budget")
  if limit and need > limit:
    raise ValueError(f"{name}: {need} positions exceed the model's {limit} learned positions")


def budgets(max_new_tokens, batch_size: int, out_width: int | None) -> tuple[jax.Array, int]:
  """Per-row budgets [B] int32 from an int or a per-row sequence, and the static output width
  (default: the largest budget). Every budget must be >= 1 and fit the width."""
  budget_B = np.broadcast_to(np.asarray(max_new_tokens, np.int64), (batch_size,))
  if budget_B.min() < 1:
    raise ValueError(f"max_new_tokens must be >= 1 for every row, got {budget_B.tolist()}")
  largest = int(budget_B.max())
  out_width = out_width or largest
  if largest > out_width:
    raise ValueError(f"max_new_tokens {largest} exceeds out_width {out_width}")
  return jnp.asarray(budget_B, jnp.int32), out_width


def empty_buffer(batch_size: int, width: int) -> OutputBuffer:
  return OutputBuffer(tokens=jnp.zeros((batch_size, width), jnp.int32), counts=jnp.zeros((batch_size,), jnp.int32),
                      done=jnp.zeros((batch_size,), bool))


def append(buffer: OutputBuffer, chunk_BxT: jax.Array, num_new_B: jax.Array, eos_ids_E: jax.Array,
           budget_B: jax.Array) -> tuple[OutputBuffer, jax.Array]:
  """Appends the first `num_new_B[b]` tokens of each live row's chunk, cut after the first EOS and at
  the row's budget. Returns the buffer and how many tokens each row kept ([B] int32).

  The whole chunk is written at the row's offset (a fixed-shape write); whatever lies past the kept
  tokens is overwritten by the next append or padded away by `finalize`.
  """
  T = chunk_BxT.shape[1]
  index_T = jnp.arange(T)
  is_eos_BxT = jnp.any(chunk_BxT[:, :, None] == eos_ids_E[None, None, :], axis=-1)
  is_eos_BxT &= index_T[None, :] < num_new_B[:, None]
  first_eos_B = jnp.where(is_eos_BxT.any(axis=1), jnp.argmax(is_eos_BxT, axis=1), T)
  kept_B = jnp.minimum(jnp.minimum(num_new_B, first_eos_B + 1), budget_B - buffer.counts)
  kept_B = jnp.where(buffer.done, 0, kept_B).astype(jnp.int32)
  write = lambda row_O, chunk_T, offset: jax.lax.dynamic_update_slice(row_O, chunk_T, (offset,))
  tokens_BxO = jnp.where(buffer.done[:, None], buffer.tokens, jax.vmap(write)(buffer.tokens, chunk_BxT, buffer.counts))
  counts_B = buffer.counts + kept_B
  hit_eos_B = (first_eos_B < kept_B) & ~buffer.done
  done_B = buffer.done | hit_eos_B | (counts_B >= budget_B)
  return OutputBuffer(tokens=tokens_BxO, counts=counts_B, done=done_B), kept_B


def finalize(buffer: OutputBuffer, pad_id: int) -> jax.Array:
  """[B, O] tokens with everything past each row's count set to `pad_id`."""
  valid_BxO = jnp.arange(buffer.tokens.shape[1])[None, :] < buffer.counts[:, None]
  return jnp.where(valid_BxO, buffer.tokens, pad_id)


def as_token_lists(tokens_BxO: np.ndarray, counts_B: np.ndarray) -> list[list[int]]:
  return [list(map(int, row[:n])) for row, n in zip(np.asarray(tokens_BxO), np.asarray(counts_B))]
