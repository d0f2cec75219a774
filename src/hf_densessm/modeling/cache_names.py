"""The cache's name: ``cache`` inside this package, the installed release's at the boundary (``cache`` from 5.24,
``past_key_values``, ``cache_params`` in Mamba, before; docs/design.md §5, "The cache's name")."""

from __future__ import annotations

import functools
import inspect

from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils.deprecation import deprecate_kwarg

#: The names of a model output's cache field, newest first (docs/design.md §5, "The cache's name").
CACHE_FIELDS = ("cache", "past_key_values", "cache_params")

#: Whether the installed transformers calls the cache ``cache`` (5.24 and later), read off its own output class.
CACHE_RENAMED = "cache" in CausalLMOutputWithPast.__dataclass_fields__

#: The release in which transformers drops the old keywords (what its own models pass to ``deprecate_kwarg``).
OLD_CACHE_NAMES_REMOVED_IN = "5.40.0"


def takes_cache(function):
    """Decorate a function written with a ``cache`` keyword so that it also takes the cache under transformers' old
    names (``CACHE_FIELDS[1:]``): with ``deprecate_kwarg`` from 5.24, else silently (listed in the signature; two
    different objects under two of the names are a ``ValueError``)."""
    if CACHE_RENAMED:
        for name in CACHE_FIELDS[1:]:
            function = deprecate_kwarg(name, OLD_CACHE_NAMES_REMOVED_IN, new_name="cache")(function)
        return function

    @functools.wraps(function)
    def with_old_names(*args, **kwargs):
        for name in [name for name in CACHE_FIELDS[1:] if name in kwargs]:
            value, current = kwargs.pop(name), kwargs.get("cache")
            if current is None:
                kwargs["cache"] = value
            elif value is not None and value is not current:
                raise ValueError(f"Give the cache once: `cache` and `{name}` are different objects.")
        return function(*args, **kwargs)

    signature = inspect.signature(function)
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in CACHE_FIELDS[1:]]
    parameters = sorted([*signature.parameters.values(), *added], key=lambda p: p.kind)  # stable: before **kwargs
    with_old_names.__signature__ = signature.replace(parameters=parameters)
    return with_old_names


def cache_field(output_class: type) -> str:
    """The field of ``output_class`` (a ``ModelOutput`` dataclass) that holds the cache, one of :data:`CACHE_FIELDS`;
    ``TypeError`` if it declares none."""
    declared = getattr(output_class, "__dataclass_fields__", {})
    if name := next((name for name in CACHE_FIELDS if name in declared), None):
        return name
    raise TypeError(f"{output_class.__name__} has no cache field (one of {CACHE_FIELDS}).")


def model_output(output_class: type, cache: Cache | None, **fields):
    """``output_class(**fields)`` with ``cache`` in its cache field (:func:`cache_field`)."""
    return output_class(**fields, **{cache_field(output_class): cache})


def output_cache(outputs) -> Cache | None:
    """The cache a model output holds (a transformers ``ModelOutput`` with a cache field, :func:`cache_field`)."""
    return getattr(outputs, cache_field(type(outputs)))


def generate_keyword(old_names: tuple[str, ...]) -> str:
    """The keyword ``generate()`` keeps a model's cache under: ``cache`` from 5.24, else the model's first old name
    (5.17-5.23 keep it under ``cache_params`` for a Mamba, ``past_key_values`` otherwise)."""
    return "cache" if CACHE_RENAMED else old_names[0]


def with_old_name(output_class: type) -> type:
    """Before 5.24, add a ``past_key_values`` property (the cache, by :func:`output_cache`) to ``output_class``, the
    name transformers' generic heads read on every backbone's output; returns the class."""
    if not CACHE_RENAMED and "past_key_values" not in getattr(output_class, "__dataclass_fields__", {}):
        output_class.past_key_values = property(output_cache, doc="The cache, under the name generic heads read.")
    return output_class
