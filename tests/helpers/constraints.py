"""Constrained decoding's test kit: byte strings for the tiny models' vocabularies, regular expressions over
them, an independent oracle (the `regex` module's partial matching: is this text a prefix of a match?),
the exact distribution of a model's first tokens under a constraint, and a greedy reference decoder that
masks with the oracle token by token."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import regex

from specjax.constraints import compiler
from specjax.constraints.mask import constrained
from specjax.models.kv_cache import init_cache
from specjax.models.transformer import forward
from specjax.testing import reference
from tests.helpers import engine
from tests.helpers.stats import chi_square_pvalue

EOS = 0
_SINGLES = b'abcdefghij0123456789{}":, -'
_PAIRS = [
    b'{"', b'":', b'" ', b'ab', b'ba', b'cd', b'12', b'00', b'-1', b'}"', b', ', b'"a', b'hi', b'jj', b'a"', b'99',
    b'{}', b'"}', b'ef', b'gh', b'abc', b'":"', b'de', b'  ', b'x', b'0a', b'a1', b'{"a', b'b"', b'10', b':1', b'ca',
    b'::'
]
STRINGS_61 = [b""] + [bytes([c]) for c in _SINGLES] + _PAIRS  # id 0 = EOS; 61 ids (engine.VOCAB)
assert len(STRINGS_61) == 61
# A JSON-ish object with one key and a number or a string value; and a plain list of digits.
OBJECT_REGEX = r'\{"[a-j]{1,4}": ?(-?[0-9]{1,3}|"[a-e]{0,5}")\}'
DIGITS_REGEX = r'[0-9]{2,6}(, [0-9]{1,2})*'
STRINGS_8 = [b"", b"a", b"b", b"c", b"ab", b"ba", b"cc", b"x"]  # engine.SMALL_TARGET's 8 ids
SMALL_REGEX = r'(ab|ba|c|aab)+'  # every state but the start accepts; the allowed tokens vary with the state


def allowed_by_oracle(pattern, strings, text: bytes, token: int) -> bool:
  """Whether `token` may follow `text` under `pattern` (EOS: text matches; else text + the token's bytes
  is a prefix of a match), computed by `regex`, independently of the compiled table."""
  decoded = text.decode("latin-1")
  if token == EOS:
    return regex.fullmatch(pattern, decoded) is not None
  piece = strings[token]
  return bool(piece) and regex.fullmatch(pattern, decoded + piece.decode("latin-1"), partial=True) is not None


def oracle_mask(pattern, strings, text: bytes) -> np.ndarray:
  """bool [V]: the tokens the oracle allows after `text`."""
  return np.array([allowed_by_oracle(pattern, strings, text, t) for t in range(len(strings))])


def device_constraint(patterns, strings, rows):
  """A `Constrained` for `rows` rows, row b under `patterns[b % len(patterns)]` (stacked tables)."""
  tables = [compiler.compile_table(p, strings, [EOS]) for p in patterns]
  next_ZxV, starts = compiler.stack(tables)
  return constrained(next_ZxV, starts[np.arange(rows) % len(patterns)])


def exact_constrained_distribution(model, prompt, pattern, strings, temperature, steps):
  """P(first `steps` generated tokens) [V] * steps under the constraint, float64, by enumeration: logits
  from the library's forward, masked by the oracle, probabilities from `reference`. EOS is absorbing (the
  output is padded with id 0 = EOS after it)."""
  config, params = model
  vocab = config.vocab_size
  prefixes = np.array(list(itertools.product(range(vocab), repeat=steps - 1)), np.int32)
  tokens = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1)
  logits, _ = jax.jit(forward, static_argnums=0)(config, params, jnp.asarray(tokens),
                                                 init_cache(config, len(tokens), tokens.shape[1]))
  logits = np.asarray(logits[:, len(prompt) - 1:], np.float64)  # [V^(s-1), s, V]
  joint = np.zeros([vocab] * steps)
  for index, prefix in enumerate(prefixes):
    probability, text = 1.0, b""
    for step in range(steps):
      token = prefix[step] if step < steps - 1 else None
      if probability == 0.0:  # an impossible prefix (its text may leave the constraint)
        break
      if step and prefix[step - 1] == EOS:  # after EOS: EOS again with certainty
        conditional = np.eye(vocab)[EOS]
      else:
        masked = np.where(oracle_mask(pattern, strings, text), logits[index, step], -np.inf)
        conditional = reference.probabilities(masked, temperature)
      if token is None:
        joint[tuple(prefix)] += probability * conditional
      else:
        probability *= conditional[token]
        text += strings[token]
  return joint


@functools.lru_cache(maxsize=None)
def _exact_small() -> np.ndarray:
  return exact_constrained_distribution(engine.SMALL_TARGET, engine.SAMPLE_PROMPT, SMALL_REGEX, STRINGS_8, 1.0,
                                        engine.SAMPLE_STEPS).ravel()


def small_pvalue(tokens_ZxT: np.ndarray) -> float:
  """The chi-square p-value of rows of engine.SMALL_TARGET's first SAMPLE_STEPS tokens after SAMPLE_PROMPT
  under SMALL_REGEX at T = 1, against the exact masked distribution (enumerated once per process)."""
  index = np.ravel_multi_index(tokens_ZxT.T, [len(STRINGS_8)] * tokens_ZxT.shape[1])
  exact = _exact_small()
  return chi_square_pvalue(np.bincount(index, minlength=exact.size), exact)


_forward = jax.jit(forward, static_argnums=0)


def greedy_reference(model, prompts, budgets, pattern, strings, width=48):
  """Each prompt's greedy continuation under the constraint, one full forward per token (padded to
  `width`: one compiled program) and the oracle's mask: the reference for the engine's greedy output."""
  config, params = model
  outputs = []
  for prompt, budget in zip(prompts, budgets):
    generated, text = [], b""
    while len(generated) < budget and (not generated or generated[-1] != EOS):
      sequence = np.zeros((1, width), np.int32)
      sequence[0, :len(prompt) + len(generated)] = list(prompt) + generated
      logits, _ = _forward(config, params, jnp.asarray(sequence), init_cache(config, 1, width))
      masked = np.where(oracle_mask(pattern, strings, text), np.asarray(logits[0, len(prompt) + len(generated) - 1]),
                        -np.inf)
      generated.append(int(np.argmax(masked)))
      text += strings[generated[-1]]
    outputs.append(generated)
  return outputs
