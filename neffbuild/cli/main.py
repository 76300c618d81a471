"""The command line's group and its one exit point: `neffbuild --help` by sections, logging on
stderr, the commands (cli/commands/, one module per section) registered by name and imported only
when one runs or help lists them, and typed errors turned into one line plus a hint and their exit
code."""

from __future__ import annotations

import gc
import importlib
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

import click

from neffbuild.cli.terminal import DEBUG, JSON_LOGS, json_line, json_logs_asked, print_error, sanitised_lines, say
from neffbuild.cli.views import printed_document
from neffbuild.errors import NeffbuildError
from neffbuild.version import __version__

# `neffbuild --help` lists the commands by who runs them, in the order they run.
SECTIONS = (
    ("CI: prebuild and publish", ("plan", "build", "release", "push", "tag", "keygen", "schema", "recipe", "suggest")),
    ("A serving host", ("pull", "env", "status", "doctor", "verify", "warmup")),
    ("The store", ("ls", "show", "diff", "du", "gc")),
)
# Where each command lives (its module's COMMANDS): a call imports its own section's module
# only, so `pull` on a host's boot pays for no CI view or store listing.
MODULES = {
    "neffbuild.cli.commands.ci": SECTIONS[0][1],
    "neffbuild.cli.commands.host": SECTIONS[1][1],
    "neffbuild.cli.commands.store": SECTIONS[2][1],
}


class _ByUser(click.Group):
    """A group whose help lists commands in SECTIONS (any other command last, under "Other"), each
    section's module imported when one of its commands is first asked for (MODULES)."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands:
            module = next((m for m, names in MODULES.items() if cmd_name in names), None)
            if module is not None:
                _register(self, module)
        return super().get_command(ctx, cmd_name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        for module in MODULES:
            _register(self, module)
        return super().list_commands(ctx)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        commands = {name: self.commands[name] for name in self.list_commands(ctx)}
        listed = {name for _, names in SECTIONS for name in names}
        sections = [*SECTIONS, ("Other", tuple(sorted(set(commands) - listed)))]
        width = formatter.width - 6 - max(map(len, commands), default=0)
        for title, names in sections:
            rows = [(n, commands[n].get_short_help_str(width)) for n in names if n in commands]
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


@click.group(cls=_ByUser, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="neffbuild")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors (and log everything).")
@click.option("-v", "--verbose", count=True, help="Log what each step does (-vv: and its details).")
@click.option("-q", "--quiet", is_flag=True, help="Log errors only.")
@click.option(
    "--log-format", type=click.Choice(["plain", "json"]), default="plain", show_default=True,
    help="json: one object per line (time, level, logger, message), for journald or CloudWatch agents.",
)  # fmt: skip  # an option's names, type and help kept together
def cli(debug: bool, verbose: int, quiet: bool, log_format: str) -> None:
    """Build, publish and pull compiled-model caches for static-shape pipelines.

    manifest -> units -> bundles -> release -> tag -> cache dir
    """
    DEBUG["on"] = debug
    JSON_LOGS["on"] = log_format == "json"
    level = logging.ERROR if quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose + 2 * debug, 2)]
    _log_to_stderr(level, log_format)


def _register(group: click.Group, module: str) -> None:
    """Add a section module's COMMANDS to the group (once: a second import is a dict lookup)."""
    for command in importlib.import_module(module).COMMANDS:
        group.commands.setdefault(command.name or "", command)


class _PrintableFormatter(logging.Formatter):
    """Log records name stores, paths and units: each line passes the sanitiser."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"{record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return sanitised_lines(text)


class _JsonFormatter(logging.Formatter):
    """One JSON object per record and line; the strings exact (JSON escapes what a terminal acts on)."""

    def format(self, record: logging.LogRecord) -> str:
        trace = self.formatException(record.exc_info) if record.exc_info else None
        level, message = record.levelname.lower(), record.getMessage()
        return json_line(level, record.name, message, record.created, traceback=trace)


def _log_to_stderr(level: int, log_format: str = "plain") -> None:
    """The library logs through `logging` (never prints): the CLI shows its records on stderr."""
    logger = logging.getLogger("neffbuild")
    handler = next((h for h in logger.handlers if getattr(h, "neffbuild_cli", False)), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.neffbuild_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    handler.setFormatter(_JsonFormatter() if log_format == "json" else _PrintableFormatter())
    logger.setLevel(level)
    # With json, Python's warnings too: they would be plain lines among the objects.
    logging.captureWarnings(log_format == "json")
    logging.getLogger("py.warnings").handlers[:] = [handler] if log_format == "json" else []
    # diffusers imports torchao where it is installed (the quantize extra), and that import warns
    # on every plan, through three libraries' own handlers: torchao's CUDA-only kernels did not
    # load on a CPU host, torch deprecates its Enum pytree constant, diffusers 0.42 misses a
    # torchao 0.18 class it only needs to load torchao checkpoints. None is this command's news.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    for name in _IMPORT_NOISE:
        noisy = logging.getLogger(name)
        if not any(isinstance(f, _ImportNoise) for f in noisy.filters):
            noisy.addFilter(_ImportNoise())


_IMPORT_NOISE = {
    "torch.utils._pytree": "register_constant() on Enum subclasses",
    "diffusers.quantizers.torchao.torchao_quantizer": "Unable to import `torchao` Tensor objects",
}


class _ImportNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _IMPORT_NOISE.get(record.name, "\0") not in record.getMessage()


def main(argv: list[str] | None = None) -> None:
    """The one exit point: typed errors become one line plus a hint and their exit code."""
    # What start-up imported lives as long as the process: keep it out of every later garbage
    # collection (those run often while thousands of small files land, and scanned it all).
    gc.freeze()
    args = sys.argv[1:] if argv is None else argv
    # Before the group parses it: a usage error is said as the command line asked too.
    JSON_LOGS["on"] = json_logs_asked(args)
    code = _run(lambda: cli.main(args=args, prog_name="neffbuild", standalone_mode=False), as_json="--json" in args)
    sys.exit(code)


def _run(invoke: Callable[[], Any], *, as_json: bool = False) -> int:
    try:
        invoke()
        return 0
    except NeffbuildError as exc:
        print_error(
            exc.message, exc.hint, exc.details, exc.debug_detail, kind=type(exc).__name__, exit_code=exc.exit_code
        )
        if (
            as_json and not printed_document()
        ):  # machines read stdout: the failure as a document too (the lines above stay for logs)
            error = {"error": exc.message, "kind": type(exc).__name__, "exit_code": exc.exit_code, "hint": exc.hint}
            if exc.details:
                error["details"] = [line.strip() for line in exc.details]
            sys.stdout.write(json.dumps(error, indent=2) + "\n")
        return exc.exit_code
    except click.exceptions.Abort:
        say("aborted", level="error")
        return 130
    except click.ClickException as exc:
        if JSON_LOGS["on"]:
            print_error(exc.format_message(), None, kind=type(exc).__name__, exit_code=exc.exit_code)
        else:
            exc.show()
        return exc.exit_code
    except KeyboardInterrupt:
        say("interrupted", level="error")
        return 130
    except Exception as exc:  # noqa: BLE001 - the last resort keeps output to one line
        print_error(
            f"internal error: {type(exc).__name__}: {exc}",
            "rerun with --debug for a traceback, and report it",
            kind=type(exc).__name__,
            exit_code=1,
        )
        return 1
