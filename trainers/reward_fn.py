"""The user's reward function of task ``jsonl``: the spec that names it, its import, and the value it returns.

Below both ``trainers.tasks`` (which scores with it) and ``trainers.reward_worker`` (the process that imports and
calls it), so that neither imports the other for it. Nothing here imports torch: the worker process starts fast.
"""

from __future__ import annotations

import decimal
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
from typing import Any, Callable, Optional

RewardFunction = Callable[[str, str, dict], Any]


class RewardSpecError(ValueError):
    """``task.reward`` names nothing usable (not an error raised by the user's module)."""


def _reward_error(spec: str, why: str) -> ValueError:
    return RewardSpecError(f"config error at 'task.reward': {spec!r}: {why}")


def load_reward(spec: str) -> RewardFunction:
    """The function ``spec`` names: ``module:function`` (imported with the working directory on the search path,
    as ``python -m`` has it) or ``path/to/file.py:function`` (a relative path from the working directory).

    The function is called as ``function(prompt, completion, example)`` (see ``JsonlTask``). Raises ValueError
    naming ``task.reward`` when the module cannot be imported (with the import's own error), has no such
    attribute, or the attribute does not take three positional arguments.
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise _reward_error(spec, "expected 'module:function' or 'path/to/file.py:function'")
    try:
        module = _import_reward_module(target, spec)
    except RewardSpecError:
        raise
    except BaseException as exc:  # the user's module runs arbitrary code at import, SystemExit included
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise _reward_error(spec, f"importing {target!r} failed: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise _reward_error(spec, f"{target!r} has no {name!r} (its functions: {', '.join(found) or 'none'})")
    if not callable(fn):
        raise _reward_error(spec, f"{name!r} in {target!r} is a {type(fn).__name__}, not a function")
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise _reward_error(spec, f"{name!r} is an async function: its calls return awaitables, not numbers; make it "
                                  f"a plain def (run any awaits inside it with asyncio.run)")
    if inspect.isgeneratorfunction(fn):
        raise _reward_error(spec, f"{name!r} is a generator function (it yields): a reward must return one number")
    try:
        inspect.signature(fn).bind("prompt", "completion", {})
    except TypeError as exc:
        raise _reward_error(spec, f"the function must take (prompt, completion, example): {exc}") from exc
    except ValueError:  # no signature to read (some builtins): the first call will tell
        pass
    return fn


def _import_reward_module(target: str, spec: str):
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = os.path.abspath(target)
        if not path.endswith(".py"):
            raise _reward_error(spec, "a reward file must be a Python file ending in .py")
        if not os.path.isfile(path):
            raise _reward_error(spec, f"file not found: {path}")
        # one module per file, shared by every load in the process
        module_name = "dcmdp_reward_" + hashlib.sha256(path.encode()).hexdigest()[:16]
        if module_name in sys.modules:
            return sys.modules[module_name]
        found = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(found)
        sys.modules[module_name] = module
        try:
            found.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
        return module
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # after the installed packages: a local file never shadows one
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and target.split(".")[0] == exc.name.split(".")[0]:
            raise _reward_error(spec, f"no module {exc.name!r} in the working directory {cwd} or on the Python "
                                        f"path; give a file instead: path/to/file.py:function") from exc
        raise


def as_number(value: Any) -> tuple[Optional[float], Optional[str]]:
    """(the reward as a float, None) or (None, why it is not usable): a finite real number; bool counts as 0 or 1,
    and numpy scalars (``np.bool_``, ``np.float32``, ...) as the Python values they hold."""
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        value = value.item()
    if isinstance(value, decimal.Decimal):
        value = float(value)
    if not isinstance(value, numbers.Real):
        return None, f"returned {type(value).__name__} {repr(value)[:40]}, not a number"
    number = float(value)
    if not math.isfinite(number):
        return None, f"returned {number}"
    return number, None
