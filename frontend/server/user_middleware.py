"""--middleware: an operator's own ASGI middleware, given as an import path (vLLM's flag). A class is
added with app.add_middleware, an async function as an HTTP middleware (`@app.middleware("http")`).

No FastAPI import here: the launcher imports each path first, so that a typo stops `engine serve` with
one clear line before the engine loads.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any


def import_middleware(path: str) -> Any:
    """`package.module.Name` (or `package.module:Name`) -> the class or function; SystemExit if it is
    neither or cannot be imported."""
    module_name, _, name = path.replace(":", ".").rpartition(".")
    if not module_name or not name:
        raise SystemExit(
            f"--middleware {path}: give module.name, e.g. my_package.middleware.Timing (a class) or my_package.middleware.log_request (a function)"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        # NOTE: the `engine` console script's sys.path lacks the working directory, which the API
        # servers (`python -m`) have: without it, a module beside the operator would pass there only.
        sys.path.insert(0, os.getcwd())
    try:
        value = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise SystemExit(f"--middleware {path}: cannot import it ({error})") from None
    if not (inspect.isclass(value) or inspect.iscoroutinefunction(value)):
        raise SystemExit(
            f"--middleware {path}: expected an ASGI middleware class or an async function "
            f"`(request, call_next)`, got a {type(value).__name__}"
        )
    return value


def add_user_middleware(app: Any, paths: list[str]) -> None:
    """Each path's middleware, in the order given (the last added runs first, as Starlette stacks them)."""
    for path in paths:
        middleware = import_middleware(path)
        if inspect.isclass(middleware):
            app.add_middleware(middleware)
        else:
            app.middleware("http")(middleware)
