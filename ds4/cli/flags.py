"""What the three commands share on their command lines: --help with defaults, --version."""

from __future__ import annotations

import argparse

from ds4 import __version__


class ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """--help lists each flag's default, except where there is none to show (None, off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.required:
            return action.help
        return super()._get_help_string(action)


def add_version(p: argparse.ArgumentParser) -> None:
    """`--version`: the program's name and the ds4 version, then exit 0."""
    p.add_argument("--version", action="version", version=f"%(prog)s (ds4) {__version__}")
