"""The errors of bad input: a config that cannot be used (``ConfigError``, raised through ``require``) and a file or
path the user named that is missing or malformed. A leaf module, so that the config blocks, the task and tokenizer
loaders raise them, and ``dcmdp`` (which re-exports them from ``dcmdp.errors``) maps them to exit code 2."""

import errno
import os
import stat


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key. Defined here, below every config block, so each
    block's ``check()`` raises it (``require``); ``dcmdp.config`` and ``dcmdp.errors`` re-export it."""


def config_error(key: str, message: str, *, what: str = "config") -> ConfigError:
    """The error of a config key: ``config error at '<key>': <message>`` (``what``: "tune config" for a tune
    file's key). Raised as is where the message can only be written once the check failed (the offending element
    of a list); everywhere else through ``require``."""
    return ConfigError(f"{what} error at '{key}': {message}")


def require(cond: object, key: str, message: str, *, what: str = "config") -> None:
    """The one way a config check fails: raise ``config_error(key, message)`` unless ``cond`` holds."""
    if not cond:
        raise config_error(key, message, what=what)


class InputError(ValueError):
    """A file or path the user named is missing or malformed; the message names it and the fix."""


class InputFileNotFoundError(InputError, FileNotFoundError):
    """A file or directory the user named does not exist: still a ``FileNotFoundError`` to callers."""


class InputNotADirectoryError(InputError, NotADirectoryError):
    """A path the user named as a folder is a file: still a ``NotADirectoryError`` to callers."""


def not_a_regular_file(path) -> str | None:
    """Why ``path`` cannot be read as a file the user wrote, in words ("does not exist", "is a directory, not a
    file", "is a symbolic link loop ...", "is not a regular file (a FIFO, a named pipe)", ...), or None for a regular
    file. A FIFO or a device
    is refused before it is opened: a FIFO blocks the reader until a writer comes, ``/dev/zero`` never ends."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symbolic link loop (too many levels of symbolic links)"
        if exc.errno == errno.ENOENT:
            return ("is a symbolic link to a path that does not exist" if os.path.islink(path)
                    else "does not exist")
        if exc.errno == errno.ENAMETOOLONG:
            return "has a name too long for the file system (a part over 255 bytes)"
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    kind = ("a FIFO, a named pipe" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else "a special file")
    return f"is not a regular file ({kind})"
