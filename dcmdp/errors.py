"""The error a config that cannot be used raises: a leaf module, so that the config and the modules whose checks it
calls (``dcmdp.device``) raise it without importing one another."""


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key."""
