"""What commands print, one module per command group as `neffbuild --help` lists them: `ci` (plan,
build, release, push, tag), `host` (pull, env, status, doctor, verify), `store` (ls, show, diff, du,
gc), `loop` (suggest). Each view is a function of the console and a command's typed result, made a
view by `console.view` (which prints the JSON document instead under --json); `console` holds what
they share (the sanitising console, JSON documents, tables, sizes) and `progress` the per-unit
progress on stderr."""

from neffbuild.cli.views.console import Console, printed_document

__all__ = ["Console", "printed_document"]
