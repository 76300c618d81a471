"""The command line: click commands (parse, call one core function) and the views that print results."""

from neffbuild.cli.commands import cli, main

__all__ = ["cli", "main"]
