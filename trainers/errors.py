"""The error of a file or path the user named that is missing or malformed: a leaf module, so that the task and
tokenizer loaders raise it, and ``dcmdp`` (which re-exports it from ``dcmdp.errors``) maps it to exit code 2."""


class InputError(ValueError):
    """A file or path the user named is missing or malformed; the message names it and the fix."""


class InputFileNotFoundError(InputError, FileNotFoundError):
    """A file or directory the user named does not exist: still a ``FileNotFoundError`` to callers."""


class InputNotADirectoryError(InputError, NotADirectoryError):
    """A path the user named as a folder is a file: still a ``NotADirectoryError`` to callers."""
