"""CLI flags generated from frozen dataclasses: a knob is written once, as a field with its default and
its help text, and becomes `--its-name` (as vLLM's EngineArgs.add_cli_args does).

A field's metadata (made with `option()`) carries the help, and optionally: `flag` (another name),
`choices`, `parse` (a converter from the command-line string), `aliases` (flag, converter or constant,
help) that write the same field, `positional` (the model argument) and `nargs` (a list flag that takes
several values at once).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad setting, named by its flag: the CLI prints `engine CMD: error: FLAG: message` and exits 2.
    The config classes raise it, and so do the checks that run before any process starts."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag
        self.message = message


@contextlib.contextmanager
def naming(flag: str) -> Iterator[None]:
    """Inside: a ValueError from code that does not know its flag (a registry, a loader) -> ConfigError."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(flag, str(error)) from error


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    default_factory: Any = dataclasses.MISSING,
    flag: str | None = None,
    choices: list[str] | tuple[int, ...] | None = None,
    parse: Callable[[str], Any] | None = None,
    aliases: list[tuple[str, Any, str]] | None = None,
    positional: bool = False,
    nargs: str | None = None,
) -> Any:
    """A dataclass field that is also a CLI flag."""
    metadata = {
        "help": help,
        "flag": flag,
        "choices": choices,
        "parse": parse,
        "aliases": aliases or [],
        "positional": positional,
        "nargs": nargs,
    }
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def check_choices(config: Any) -> None:
    """What argparse's choices refuse on the command line, refused where the config is built in Python too
    (the LLM API's keyword arguments): a value outside a field's choices is a ConfigError naming its flag."""
    for field in dataclasses.fields(config):
        choices, value = field.metadata.get("choices"), getattr(config, field.name)
        if choices is not None and value is not None and value not in choices:
            raise ConfigError(
                flag_name(field), f"must be one of {', '.join(map(str, choices))}, got {value!r}"
            )


def flag_name(field: dataclasses.Field[Any]) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def default_of(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (it, False)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return annotation, False


def _telling(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """A flag's converter whose ValueError reaches the user: argparse prints its own `invalid X value`
    for a ValueError and hides why; an ArgumentTypeError's message is printed as it is."""

    def converted(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as error:
            kind = getattr(convert, "__name__", "value").strip("_")
            raise argparse.ArgumentTypeError(f"invalid {kind} value {text!r}: {error}") from error

    return converted


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type[Any],
    defaults: dict[str, Any] | None = None,
    only: tuple[str, ...] | None = None,
) -> None:
    """One flag per field of `cls` (or per field named in `only`: a command that uses a few of them);
    `defaults` overrides a field's default for this command (its help says so)."""
    overrides = defaults or {}
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if only is not None and field.name not in only:
            continue
        default = overrides.get(field.name, default_of(field))
        help_text = field.metadata.get("help", "")
        shown = "" if default is None or default is False or default in ([], "") else f" (default: {default})"
        kind, _ = _unwrap_optional(hints[field.name])
        parse = field.metadata.get("parse")
        parse = parse and _telling(parse)
        if field.metadata.get("positional"):
            parser.add_argument(field.name, nargs="?", default=default, help=help_text)
            continue
        name = flag_name(field)
        common: dict[str, Any] = {"dest": field.name, "default": default}
        if kind is bool:
            parser.add_argument(name, action=argparse.BooleanOptionalAction, help=help_text + shown, **common)
        elif typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            nargs = field.metadata.get("nargs")
            parser.add_argument(
                name,
                action="append",
                nargs=nargs,
                type=parse or item,
                help=help_text + (" (one or more)" if nargs else " (repeatable)"),
                **common,
            )
        else:
            parser.add_argument(
                name,
                type=parse or kind,
                choices=field.metadata.get("choices"),
                help=help_text + shown,
                **common,
            )
        for alias, convert, alias_help in field.metadata.get("aliases", []):
            if callable(convert):  # another spelling with its own unit
                parser.add_argument(alias, dest=field.name, type=_telling(convert), help=alias_help)
            else:  # a switch that sets the field to this value (vLLM's --disable-* spellings)
                parser.add_argument(
                    alias, dest=field.name, action="store_const", const=convert, help=alias_help
                )


def from_namespace(cls: type[T], namespace: argparse.Namespace, **extra: Any) -> T:
    """An instance of `cls` from the parsed flags (fields `add_flags` made), plus `extra`."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    values = {f.name: getattr(namespace, f.name) for f in fields if hasattr(namespace, f.name)}
    for name, value in values.items():
        if isinstance(value, list):  # repeats, and a repeat whose parser gave a list (a JSON list)
            flat = [v for item in value for v in (item if isinstance(item, list) else [item])]
            values[name] = list(dict.fromkeys(flat))
    return cls(**{**values, **extra})


def human_bytes(text: str) -> int:
    """'1073741824', '1G', '512M', '1.5GiB' -> bytes (powers of 1024, as vLLM's size flags)."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(value[-1:], 1)
    number = value[:-1] if scale != 1 else value
    try:
        return int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1073741824, 512M, 2G)") from None


def env_number(
    environ: Mapping[str, str], names: tuple[str, ...], *, zero_is_unset: bool = False
) -> float | None:
    """The first of `names` set in environ (ours, then vLLM's spelling), as a positive number; None when none
    is set (or, with zero_is_unset, when it is 0, as vLLM reads its sizes). Anything else is a ConfigError
    naming the variable."""
    for name in names:
        raw = environ.get(name, "").strip()
        if not raw:
            continue
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(name, f"must be a number, got {raw!r}") from None
        if zero_is_unset and value == 0:
            return None
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(name, f"must be {'0 or ' if zero_is_unset else ''}positive, got {raw!r}")
        return value
    return None
