"""``kvswapd --config kvswap.toml`` and ``kvswapd --print-config``.

A TOML file is the third source of settings: flags > ``KVSWAP_*`` environment > file >
defaults. The file's values go into click's ``default_map``, which click consults after the
command line and the environment, so click itself applies that order, and
``ctx.get_parameter_source`` tells afterwards where each value came from.

The file holds top-level keys named like the flags, ``snake_case`` or ``kebab-case``::

    cache_queue_port = 55500
    storage_dir = "/var/lib/kvswap"
    write_staging_bytes = "512MiB"
    fsync = "data"

A key that is not a setting fails start-up (exit 2) with the key's name: a typo must not
silently leave a default in place.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from typing import Any, Final, Iterable
from urllib.parse import urlsplit, urlunsplit

import click
from click.core import ParameterSource

from kvswap.common.units import parse_size

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    tomllib = None  # type: ignore[assignment]


#: The size type of kvswapd's flags. It lives here, not in cli.py, because a file's size values
#: are type-checked against it below and cli.py imports this module (no import cycle).
class ByteSize(click.ParamType):
    """A size as :func:`kvswap.common.units.parse_size` reads it (the rule remote URLs use
    too): ``268435456``, ``256M``, ``256MiB`` and ``256MB`` all mean 256 * 2**20 bytes."""

    name = "bytes"

    def convert(self, value, param, ctx):
        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


BYTES = ByteSize()


#: Options about the configuration itself; they cannot be set from the file.
NOT_IN_FILE: Final = frozenset({"config", "print_config"})
#: Settings whose value ``--print-config`` never shows.
SECRET_WORDS: Final = ("secret", "password", "token", "private")
#: ... unless they name where the secret lives, which is worth seeing.
FILE_SUFFIXES: Final = ("_file", "_path", "_dir")
#: ``ctx.meta`` key of the values read from the config file (also when one of them is bad).
FILE_VALUES_KEY: Final = "kvswap.config_file_values"


def settable_params(command: click.Command) -> dict[str, click.Parameter]:
    """The command's settings a file may set, by name: every value-carrying option except the
    ones about the configuration itself. Computed from the command, so a new flag is settable
    in the file without a change here."""
    return {p.name: p for p in command.params
            if p.name and p.expose_value and p.name not in NOT_IN_FILE and isinstance(p, click.Option)}


def read_config_file(path: str, settable: Iterable[str]) -> dict[str, Any]:
    """The file's settings, keyed by parameter name. Raises ``ValueError`` with a one-line
    reason for a file that is not TOML, an unknown key, a table, or a key given twice."""
    if tomllib is None:  # pragma: no cover - Python 3.10
        raise ValueError("reading a config file needs Python 3.11 or later (tomllib)")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path} is not valid TOML: {exc}") from None
    known = set(settable)
    out: dict[str, Any] = {}
    unknown: list[str] = []
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in known:
            unknown.append(key)
            continue
        if isinstance(value, dict):
            raise ValueError(f"{path}: {key!r} is a table; settings are top-level keys such as {name} = ...")
        if name in out:
            raise ValueError(f"{path}: {name!r} is set twice (as {name} and {name.replace('_', '-')})")
        out[name] = value
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key.replace("-", "_"), sorted(known), n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"{path}: unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(hints)}")
    return out


def load_config_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Callback of the eager ``--config`` option: runs before any other option is processed,
    so the file's values are in ``ctx.default_map`` when click resolves the rest."""
    if not value:
        return value
    settable = settable_params(ctx.command)
    try:
        values = read_config_file(value, settable)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
    # Kept where an error report can look, so a bad value is reported in the log format the
    # same file asks for.
    ctx.meta[FILE_VALUES_KEY] = values
    for name, v in values.items():
        p = settable[name]
        # click would turn true into 1 for a number; a boolean for a non-flag is a mistake.
        if isinstance(v, bool) and not getattr(p, "is_flag", False):
            raise click.BadParameter(f"{value}: {name} = {str(v).lower()} is not a valid value", ctx=ctx, param=param)
        wrong = _wrong_toml_type(p, v)
        if wrong:
            raise click.BadParameter(f"{value}: {name} = {v!r}: {wrong}", ctx=ctx, param=param)
        try:  # convert here too, so a bad value names the file it came from
            p.type_cast_value(ctx, v)
        except click.BadParameter as exc:
            raise click.BadParameter(f"{value}: {name} = {v!r}: {exc.message}", ctx=ctx, param=param) from None
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return value


def _wrong_toml_type(param: click.Parameter, value: Any) -> str:
    """Why a TOML value has the wrong type for ``param`` ("" if it fits). click converts
    leniently (int(2.7) is 2, "55500" is a port, "no" is false), which suits strings from a
    command line or an environment variable, but a file has types, and a wrong one is a
    mistake to report rather than to guess at."""
    kind = param.type
    if getattr(param, "is_flag", False) or isinstance(kind, click.types.BoolParamType):
        return "" if isinstance(value, bool) else "expected true or false"
    if isinstance(kind, ByteSize):
        return "" if isinstance(value, (int, str)) and not isinstance(value, bool) else \
            'expected a byte count or a size string such as "256MiB"'
    if isinstance(kind, click.types.IntParamType):
        return "" if isinstance(value, int) and not isinstance(value, bool) else "expected an integer"
    if isinstance(kind, click.types.FloatParamType):
        return "" if isinstance(value, (int, float)) and not isinstance(value, bool) else "expected a number"
    return "" if isinstance(value, str) else "expected a string"


def value_source(ctx: click.Context, name: str, value: Any) -> str:
    """Where the effective value of one setting came from, in words."""
    source = ctx.get_parameter_source(name)
    param = settable_params(ctx.command).get(name)
    if source is ParameterSource.COMMANDLINE:
        flag = param.opts[-1] if isinstance(param, click.Option) else name
        return f"command line ({flag})"
    if source is ParameterSource.ENVIRONMENT:
        envvar = getattr(param, "envvar", None) or f"{ctx.auto_envvar_prefix}_{name.upper()}"
        return f"environment ({envvar})"
    if source is ParameterSource.DEFAULT_MAP:
        return f"config file ({ctx.params.get('config')})"
    if name == "storage_dir" and os.environ.get("FILE_BACKEND_STORAGE_DIR") == value:
        return "environment (FILE_BACKEND_STORAGE_DIR)"
    return "default"


def render_config(ctx: click.Context, effective: dict[str, Any], prog: str = "kvswapd") -> str:
    """The effective configuration as TOML (usable as a ``--config`` file), each value
    followed by its source as a comment. Settings named like secrets are redacted; unset
    ones are commented out, since TOML has no null."""
    lines = [f"# {prog}: effective configuration; after each value, where it came from.",
             "# Precedence: command line > environment (KVSWAP_*) > config file > default."]
    for name in settable_params(ctx.command):
        value = effective.get(name, ctx.params.get(name))
        source = value_source(ctx, name, value)
        if value is None:
            lines.append(f"# {name} = (unset)  # {source}")
        elif any(word in name for word in SECRET_WORDS) and not name.endswith(FILE_SUFFIXES):
            lines.append(f'{name} = "<redacted>"  # {source}')
        elif name == "storage_dir" and source in ("default", "environment (FILE_BACKEND_STORAGE_DIR)"):
            # Commented out: saved as a config file, a pinned storage_dir would override
            # FILE_BACKEND_STORAGE_DIR wherever the file is used next.
            lines.append(f"# {name} is not pinned, so FILE_BACKEND_STORAGE_DIR stays in charge; uncomment to pin it")
            lines.append(f"# {name} = {_toml_value(value)}  # {source}")
        elif isinstance(value, str) and mask_url_password(value) != value:
            lines.append(f"{name} = {_toml_value(mask_url_password(value))}  # {source}; password masked")
        else:
            lines.append(f"{name} = {_toml_value(value)}  # {source}")
    return "\n".join(lines) + "\n"


def mask_url_password(value: str) -> str:
    """``redis://:pw@host:6379/0`` -> ``redis://***@host:6379/0``, as the logs show it; other
    values unchanged."""
    try:
        parts = urlsplit(value)
        password = parts.password
    except ValueError:
        return value
    if not parts.scheme or not password:
        return value
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def print_config(ctx: click.Context, effective: dict[str, Any]) -> None:
    sys.stdout.write(render_config(ctx, effective))
    sys.stdout.flush()


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    # A JSON string without ASCII escaping is a valid TOML basic string: both escape '"', '\'
    # and control characters the same way.
    return json.dumps(str(value), ensure_ascii=False)
