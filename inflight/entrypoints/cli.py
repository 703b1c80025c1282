"""The ``inflight`` command: generate, serve, bench, plot.

Each subcommand lives in its own module with ``register(subparsers)``; heavy imports
(torch, the model) happen only when a subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from inflight.entrypoints.config_file import with_config_file

EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a Ctrl-C

# subcommand modules, each exposing register(subparsers) that sets a ``handler`` default
SUBCOMMAND_MODULES = [
    "inflight.entrypoints.generate_cli",  # inflight generate
    "inflight.entrypoints.serve_cli",  # inflight serve
    "inflight.bench.cli",  # inflight bench {throughput,serve}
    "inflight.bench.plot_cli",  # inflight plot
    "inflight.planner.cli",  # inflight calibrate, inflight simulate
]


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, unless it says nothing useful.

    Left out: defaults that are None or booleans (a flag's default is its absence), and
    help strings that already describe their default.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if (
            action.default is None
            or isinstance(action.default, bool)
            or action.default is argparse.SUPPRESS
            or "default" in help_text.lower()
            or not action.option_strings
        ):
            return help_text
        return super()._get_help_string(action) or help_text


def _use_formatter(parser: argparse.ArgumentParser) -> None:
    """Set the defaults-showing formatter on ``parser`` and every subcommand below it."""
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        shows_default = action.default is not None and not isinstance(action.default, bool)
        if action.help is None and action.option_strings and shows_default:
            action.help = "(default: %(default)s)"  # argparse omits options without help
        if isinstance(action, argparse._SubParsersAction):
            for child in set(action.choices.values()):
                _use_formatter(child)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inflight",
        description="LLM inference with continuous batching over a paged KV cache",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    _use_formatter(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    given = sys.argv[1:] if argv is None else argv
    try:
        argv = with_config_file(
            given,
            lambda flag: _action(parser, given, flag) is not None,
            lambda flag: isinstance(_action(parser, given, flag), argparse._AppendAction),
        )
    except ValueError as error:
        print(f"inflight: error: {error}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (ValueError, OSError) as error:  # bad values, missing or unwritable files
        print(f"inflight: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C while a model loads, warms up or generates (a running server handles its
        # own): one line, not the stack of whatever happened to be computing.
        print("inflight: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _action(parser: argparse.ArgumentParser, argv: list[str], flag: str) -> argparse.Action | None:
    """The option ``flag`` of the subcommand ``argv`` names, if it has one."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and argv and argv[0] in action.choices:
            return action.choices[argv[0]]._option_string_actions.get(flag)
    return None


if __name__ == "__main__":
    sys.exit(main())
