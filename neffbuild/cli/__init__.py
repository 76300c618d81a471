"""The command line: click commands (parse, call one core function) and the views that print results."""

from neffbuild.cli.main import cli, main

__all__ = ["cli", "main"]
