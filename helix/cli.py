"""The ``helix`` command line: parses arguments and hands each command to its package.

Each subcommand's implementation lives with the package that owns the work
(``planner.commands``, ``router.commands``, ``node_agent.commands``, ``simulator.commands``,
``profiler.commands``) and is imported only when that command runs, so ``import helix``
stays light. Every :class:`~helix.errors.HelixError` becomes one red line on stderr and
the error's exit code — never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence

from helix import __version__
from helix.errors import HelixError

# command name -> (module that owns it, help). The module defines add_<name>_arguments(parser)
# and run_<name>(args) -> exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("planner.commands", "Plan a cluster: which contiguous layers every node holds."),
    "evaluate": ("planner.commands", "Max flow of a given placement (plan file) on a cluster."),
    "agent": ("node_agent.commands", "Run one node agent (ZeroMQ) for a node of a planned cluster."),
    "serve": ("router.commands", "Run the coordinator: an OpenAI-compatible HTTP endpoint."),
    "demo": ("router.commands", "Plan, start and query the local demo cluster end to end."),
    "tasks": ("router.task_cli", "List, load or unload the fine-tuned tasks of a running coordinator."),
    "keys": ("router.keys_cli", "Write CURVE key pairs (ZeroMQ certificates) for a cluster's coordinator and nodes."),
    "simulate": ("simulator.commands", "Simulate a planned cluster under a workload."),
    "profile": ("profiler.commands", "Measure GPUs and links of a cluster and write its profiles."),
    "init": ("profiler.starter", "Write a commented starter cluster (and estimated profiles) for the GPUs you name."),
    "show": ("planner.commands", "Draw a plan (graph, layer ranges, flows) to a PNG."),
}


# Collaborators the command line hands a command, as attributes of its parsed arguments: command ->
# {attribute: (module, name)}. This is the composition root for packages that may not import each
# other (DESIGN.md): `helix plan`'s simulated refinement runs the simulator, which imports the planner.
WIRING: dict[str, dict[str, tuple[str, str]]] = {
    "plan": {"simulator": ("simulator.short_run", "run_short")},
}


def _module(name: str):  # noqa: ANN202 - module object
    return importlib.import_module(COMMANDS[name][0])


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default: argparse's ``(default: X)`` after the help text,
    unless the text already states it or there is none to state (no value, a flag, a counter)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or "%(default)" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        if isinstance(action, argparse._CountAction):
            return text
        return super()._get_help_string(action)


def build_parser(available: Callable[[str], bool] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="helix", description="Serve LLMs on clusters of mixed GPUs.",
                                     formatter_class=HelpFormatter)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument("--version", action="version", version=f"helix {__version__}", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        if available is not None and not available(name):
            continue
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        getattr(_module(name), f"add_{name}_arguments")(p)
    return parser


def _importable(name: str) -> bool:
    try:
        mod = _module(name)
    except ImportError:
        return False
    return hasattr(mod, f"add_{name}_arguments")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(_importable)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2), format="%(levelname)s %(name)s: %(message)s"
    )
    if not args.command:
        parser.print_help()
        return 2
    for attribute, (module, name) in WIRING.get(args.command, {}).items():
        setattr(args, attribute, getattr(importlib.import_module(module), name))
    try:
        return int(getattr(_module(args.command), f"run_{args.command}")(args) or 0)
    except HelixError as exc:
        from rich.console import Console
        from rich.markup import escape

        Console(stderr=True, highlight=False).print(f"[bold red]error:[/] {escape(exc.message)}", soft_wrap=True)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
