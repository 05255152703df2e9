"""Checks for the optional packages a command's flags need, made before any work is done."""

from __future__ import annotations

import importlib.util


def check_plot(plot: object) -> None:
    """ValueError when ``--plot`` is given and matplotlib is not installed (it is in the
    ``plot`` extra, not in what ``make run`` installs): said before the run, not after it."""
    if plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            "--plot needs matplotlib: .venv/bin/pip install -e '.[plot]' (make install-dev "
            "has it too)"
        )
