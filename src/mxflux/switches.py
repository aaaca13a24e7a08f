"""The MXFLUX_* switches: A/B knobs of the kernels, read once when their module is imported. They are not
recipe fields (a run names the ones it took in `train.step_path`); a value a switch does not take raises
`SwitchError`, whose message names the variable and what it takes, and the command line reports it as one
line with exit status 2."""

from __future__ import annotations

import os


class SwitchError(ValueError):
    """An MXFLUX_* environment variable set to a value it does not take."""


def choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """The variable's value, one of `choices` (`default` where unset)."""
    value = os.environ.get(name, default)
    if value not in choices:
        raise SwitchError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def subset(name: str, default: str, members: tuple[str, ...], value: str | None = None) -> frozenset[str]:
    """The variable (or `value`, given) as a set of `members`: `off` (none), `all`, or a comma-separated
    list of them."""
    value = os.environ.get(name, default) if value is None else value
    if value == "off":
        return frozenset()
    if value == "all":
        return frozenset(members)
    chosen = frozenset(value.split(","))
    if not chosen <= set(members):
        raise SwitchError(f"{name}: expected off, all or a comma-separated list of {', '.join(members)}; "
                          f"got {value!r}")
    return chosen


def positive_int(name: str, default: int, what: str) -> int:
    """The variable as a positive whole number (of `what`)."""
    value = os.environ.get(name, str(default))
    if not value.isdigit() or int(value) < 1:
        raise SwitchError(f"{name}: expected a positive whole number of {what}, got {value!r}")
    return int(value)
