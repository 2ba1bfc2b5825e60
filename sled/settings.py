"""Settings files for both sides: YAML in, every value checked by one set of type rules, a frozen dataclass out."""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml

# The environment variable either side reads its bearer token from, where no setting gives one.
TOKEN_ENV = "SLED_AUTH_TOKEN"


def yaml_error(path: str | Path, err: yaml.YAMLError) -> str:
    """A YAML parse error in one line, with where it is (PyYAML's own message spans five)."""
    mark = getattr(err, "problem_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    what = getattr(err, "problem", None) or " ".join(str(err).split())
    return f"{path}{where}: not valid YAML ({what})"


def read_yaml(path: str | Path, section: str) -> dict[str, Any]:
    """A YAML file's mapping of settings; a top-level `section:` mapping is taken where there is one."""
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(yaml_error(path, err)) from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a mapping of settings, got {type(loaded).__name__}")
    return loaded[section] if isinstance(loaded.get(section), dict) else loaded


def _kinds(annotation) -> tuple[set[type], bool]:
    """The value types a field takes and whether it takes None."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return {a for a in args if a is not type(None)}, type(None) in args


def check_value(name: str, value: Any, annotation) -> Any:
    """`value` for a field of type `annotation`: booleans must be true or false, integers whole numbers (not
    true, not 4.0), numbers int or float (given as float), strings strings."""
    kinds, optional = _kinds(annotation)
    if value is None:
        if optional:
            return None
        raise ValueError(f"{name} must be set, got nothing")
    if bool in kinds:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if int in kinds:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return value
    if float in kinds:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        return float(value)
    if isinstance(value, list) and any(typing.get_origin(k) is list for k in kinds):
        return value  # a list field (the device's servers): the dataclass checks its items
    if str in kinds and not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r}")
    return value


def load_settings(cls, path: str | Path | None, section: str, overrides: dict[str, Any],
                  env: typing.Mapping[str, str] | None = None):
    """`cls` (a dataclass) from the YAML file `path` (if given) with the non-None `overrides` over it, every value
    checked by `check_value`; the dataclass then checks what its values mean. A class with an auth_token takes it
    from SLED_AUTH_TOKEN in `env` (os.environ by default) where nothing else sets it."""
    values: dict[str, Any] = read_yaml(path, section) if path is not None else {}
    values.update({k: v for k, v in overrides.items() if v is not None})
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"unknown {section} settings {unknown}; known: {sorted(fields)}")
    if "auth_token" in fields:
        values = env_token(values, env)
    return cls(**{name: check_value(name, value, hints[name]) for name, value in values.items()})


def read_token_file(path: str | Path) -> str:
    """A bearer token kept in a file (its first line), so it is not on a command line or in the process list."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise ValueError(f"auth token file {path}: {err.strerror or err}") from None
    token = lines[0].strip() if lines else ""
    if not token:
        raise ValueError(f"auth token file {path} is empty")
    return token


def check_token(token: str | None, token_file: str | None) -> None:
    """The rules of a side's two token settings: not empty, not both."""
    if token is not None and not token.strip():
        raise ValueError("auth_token must not be empty: leave it unset for no authentication")
    if token is not None and token_file is not None:
        raise ValueError("give auth_token or auth_token_file, not both")
    if token_file is not None:
        read_token_file(token_file)


def env_token(values: dict[str, Any], env: typing.Mapping[str, str] | None = None) -> dict[str, Any]:
    """`values` with auth_token from SLED_AUTH_TOKEN where neither auth_token nor auth_token_file is set."""
    token = (os.environ if env is None else env).get(TOKEN_ENV)
    if token and values.get("auth_token") is None and values.get("auth_token_file") is None:
        return {**values, "auth_token": token}
    return values
