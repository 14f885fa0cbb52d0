"""The errors of bad input a user gave, which the command line exits 2 on: a config that cannot be used, and a file
or path named that is missing or malformed. A leaf module, so that the config and the modules whose checks it calls
(``dcmdp.device``) raise them without importing one another."""

from trainers.errors import ConfigError, InputError, InputFileNotFoundError, InputNotADirectoryError, require

__all__ = ["ConfigError", "InputError", "InputFileNotFoundError", "InputNotADirectoryError", "require"]
