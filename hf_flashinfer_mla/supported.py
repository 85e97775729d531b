"""The Transformers releases this package is tested with, and the one line that refuses what cannot run on another.

CI runs the whole suite on the oldest and the newest of `TESTED` (``.ci/run``), and ``pyproject.toml`` accepts
Transformers from the oldest on. A release outside `TESTED` runs whatever its code still matches: each patch of
Transformers checks the shape of what it patches when it is installed (``registration.py``), and a feature one of
whose patches does not fit is refused where it is asked for, with `refusal`'s line, never answered wrongly. Nothing
here imports more than ``transformers`` itself, so that an import of the package that fails on an old release can
still say why.
"""

from __future__ import annotations

TESTED = ("5.24", "5.25")
_MAJOR, _MINOR = TESTED[-1].split(".")
REQUIREMENT = f">={TESTED[0]},<{_MAJOR}.{int(_MINOR) + 1}"  # (the `TESTED` releases, as pip writes them)


def installed() -> str:
    """The installed Transformers' version."""
    import transformers

    return getattr(transformers, "__version__", "unknown")


def refusal(what: str, why: str, instead: str = "") -> str:
    """One line: `what` needs a tested Transformers, the installed one and `why` not, and the command that fixes it
    (and `instead`, what runs anyway, where there is something)."""
    return (f"{what} needs Transformers {REQUIREMENT} (installed: {installed()}; {why}): pip install "
            f"'transformers{REQUIREMENT}'{f', or {instead}' if instead else ''}")
