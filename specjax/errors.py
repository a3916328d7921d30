"""The kinds of error a user can cause, so that every command line reports them the same way
(`specjax.cli`): `ConfigError` is a usage error (exit status 2); any other ValueError or OSError is a
data error (a file, checkpoint or model; exit status 1)."""


class ConfigError(ValueError):
  """A config field holds a value the program cannot use; the message names the field."""
