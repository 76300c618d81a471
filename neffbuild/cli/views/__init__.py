"""What commands print, one module per command group as `neffbuild --help` lists them: `ci` (plan,
build, release, push, tag), `host` (pull, env, status, doctor, verify), `store` (ls, show, diff, du,
gc), `loop` (suggest); `console` holds what they share (the sanitising console, JSON documents, tables, sizes) and
`progress` the per-unit progress on stderr."""

from neffbuild.cli.views.ci import CiViews
from neffbuild.cli.views.console import printed_document
from neffbuild.cli.views.host import HostViews
from neffbuild.cli.views.loop import LoopViews


class Console(CiViews, HostViews, LoopViews):
    """What a command prints through: the shared console with each group's views."""


__all__ = ["Console", "printed_document"]
