"""The spec-string grammar shared by every registry (codecs, partitioners, server optimizers, tasks).

``name`` or ``name:key=value,key=value``. Kept here, in the pure bottom layer and free of any
dependency, so that every family parses specs the same way and reports the same errors.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from fedge.compression.errors import SpecError

__all__ = ["build_from_spec", "named_spec", "parse_setting", "parse_spec", "required_spec"]

T = TypeVar("T")


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``name:k=v,k=v`` into the lower-cased name and a dict of raw string values."""
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError("empty spec")
    name, _, rest = spec.strip().partition(":")
    params: dict[str, str] = {}
    if rest:
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not eq or not key or not value:
                raise SpecError(f"malformed parameter {item!r} in spec {spec!r}")
            if key in params:
                raise SpecError(f"parameter {key!r} given twice in spec {spec!r}")
            params[key] = value
    return name.strip().lower(), params


def parse_setting(spec: str, cls: Callable[..., T], name: str, setting: str, *,
                  name_optional: bool = False) -> T | None:
    """A run setting that is ``none`` (None) or ``name[:key=value,...]``: ``cls`` called with the
    parameters typed as its defaults are (how every setting's spec reads the same way; the caller
    then checks the values' ranges). ``name_optional``: ``key=value,...`` alone is the setting's
    too, and an empty spec is ``none``. Raises :class:`SpecError` naming the setting."""
    if isinstance(spec, str) and spec.strip().lower() in (("none", "") if name_optional else ("none",)):
        return None
    if name_optional:
        spec = named_spec(spec, name)
    given = parse_spec(spec)[0]
    if given != name:
        raise SpecError(f"{setting} is 'none' or '{name}[:...]', not {given!r}")
    return build_from_spec(spec, {name: cls}, family=setting)


def named_spec(spec: str, name: str) -> str:
    """``spec`` with its name: ``key=value,...`` alone (a setting whose name may be omitted) is ``name``'s."""
    return spec if not isinstance(spec, str) or ":" in spec else f"{name}:{spec}"


def required_spec(parse: Callable[[str], T | None], text: str, name: str) -> T:
    """``parse(text)`` where ``none`` is no answer (a wrapper that exists to run the feature): its
    error (a ValueError) or the ``none`` is named after the argument ``name``."""
    try:
        value = parse(text)
    except ValueError as err:
        raise ValueError(f"{name} {text!r}: {err}") from None
    if value is None:
        raise ValueError(f"{name} {text!r}: a spec is needed here, not 'none'")
    return value


def build_from_spec(
    spec: str,
    registry: dict[str, Callable[..., Any]],
    family: str = "component",
    extra: dict[str, Any] | None = None,
) -> Any:
    """Call the factory ``registry[name]`` with the spec's parameters converted to the types of
    the factory's defaults (int, float, str, bool), plus the ready-made objects in ``extra``."""
    name, raw = parse_spec(spec)
    factory = registry.get(name)
    if factory is None:
        raise SpecError(f"unknown {family} {name!r}; available: {', '.join(sorted(registry))}")
    signature = inspect.signature(factory)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        param = signature.parameters.get(key.replace("-", "_"))
        if param is None or (extra and param.name in extra):
            allowed = ", ".join(p.replace("_", "-") for p in signature.parameters) or "none"
            raise SpecError(f"{family} {name!r} has no parameter {key!r} (parameters: {allowed})")
        default = param.default
        kind = type(default)
        try:
            if kind is bool:
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                converted: Any = value.lower() in ("true", "1")
            elif default is inspect.Parameter.empty or default is None:
                converted = value
            else:
                converted = kind(value)
        except ValueError:
            what = {bool: "true or false", int: "a whole number", float: "a number"}.get(kind, kind.__name__)
            raise SpecError(f"{family} {name!r}: {key}={value!r} is not {what}") from None
        kwargs[param.name] = converted
    for key, obj in (extra or {}).items():
        if key not in signature.parameters:
            raise SpecError(f"{family} {name!r} does not take {key!r}")
        kwargs[key] = obj
    return factory(**kwargs)
