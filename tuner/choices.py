"""The closed sets the CLI's options take, as Enums: typer lists them in --help and refuses
anything else before a command prints or runs anything."""

from __future__ import annotations

from enum import Enum

from .problem import DTYPES

SAMPLERS = ("tpe", "random", "grid")


def choice(name: str, values: tuple[str, ...] | list[str]) -> type[Enum]:
    """A str Enum whose members are exactly `values` (typer shows and checks the values)."""
    return Enum(name, {v: v for v in values}, type=str)  # type: ignore[return-value]


def family_names(*, auto: bool) -> list[str]:
    """Every registered kernel family (TUNER_EXTRA_FAMILIES included), after "auto" where asked,
    then the varlen variants (tuned only when named)."""
    from .kernel_templates import FAMILIES, VARIANTS_BY_NAME

    return (["auto"] if auto else []) + list(FAMILIES) + list(VARIANTS_BY_NAME)


def _family_choice(name: str, *, auto: bool) -> type:
    """The families as a choice; plain text where the registry cannot load (a bad
    TUNER_EXTRA_FAMILIES), so that the command needing it says why in one line instead of the
    CLI failing to import."""
    try:
        return choice(name, family_names(auto=auto))
    except ValueError:
        return str


Dtype = choice("Dtype", DTYPES)
Sampler = choice("Sampler", SAMPLERS)
Family = _family_choice("Family", auto=True)
OneFamily = _family_choice("OneFamily", auto=False)
