"""``autodeploy`` command line: a thin layer over the Python API.

The commands live beside this file: ``cli_build`` (export, run, serve), ``cli_listing``
(transforms, models), ``cli_measure`` (bench, coverage). This module builds the parser and turns
errors into what a user sees: bad input (unknown transform key, bad field or flag value, bad YAML,
missing model path...) prints one line ``autodeploy: error: ...`` naming the flag the user typed
and exits with code 2; ``--debug`` (before or after the command) prints the traceback before it.
"""

import argparse
import sys
import traceback
from typing import Callable, NoReturn, Optional, Sequence

from . import __version__
from . import cli_build, cli_listing, cli_measure
from .utils.errors import AutoDeployError, RankFailure
from .utils.logging import configure_cli_logging

DEBUG_HELP = "debug logging, and the traceback of an error before its one-line message (before or after COMMAND)"


class Parser(argparse.ArgumentParser):
    """argparse with the CLI's errors: one line ``autodeploy: error: ...`` and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"autodeploy: error: {message} (see '{self.prog} --help')\n")


def _common_flags() -> argparse.ArgumentParser:
    """Flags every command also takes after its name (``autodeploy run --debug``)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="autodeploy",
        description="Compile a HuggingFace causal LM into an optimized inference graph.",
        epilog="export, run and serve take any deployment setting as a flag: --<setting> VALUE (e.g. --max_seq_len "
        "1024 --attn_backend torch) and a transform's field as --transforms.<key>.<field> VALUE (e.g. "
        "--transforms.match_rope_pattern.enabled false); 'autodeploy COMMAND --help' lists them.",
    )
    parser.add_argument("--version", action="version", version=f"autodeploy {__version__}",
                        help="print the version and exit")
    parser.add_argument("--debug", action="store_true", default=False, help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _common_flags()
    cli_listing.add_parsers(sub, common)
    cli_build.add_parsers(sub, common)
    cli_measure.add_parsers(sub, common)
    return parser


def name_the_flag(message: str, argv: Sequence[str]) -> str:
    """Errors about a setting start with its name (``attn_backend: ...``, ``max_seq_len 1024 is
    larger ...``, ``autodeploy.config.checks``); when the user gave that setting on the command line,
    the message names the flag as they typed it (``--attn_backend: ...``)."""
    for token in argv:
        if not token.startswith("--") or len(token) <= 2:
            continue
        flag = token.split("=", 1)[0]
        setting = flag[2:].replace("-", "_")
        if message.startswith(setting) and message[len(setting):len(setting) + 1] in (":", " "):
            return flag + message[len(setting):]
    return message


def _run(func: Callable[[argparse.Namespace, Sequence[str]], int], args: argparse.Namespace,
         extra: Sequence[str], argv: Sequence[str]) -> int:
    try:
        return func(args, extra)
    except RankFailure as exc:  # a rank died or hung: no bad input, but no bug here either
        if args.debug:
            traceback.print_exc()
        print(f"autodeploy: error: {exc}", file=sys.stderr)
        return 1
    except AutoDeployError as exc:  # bad input: exit 2, with or without --debug
        if args.debug:
            traceback.print_exc()
        print(f"autodeploy: error: {name_the_flag(str(exc), argv)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`
        sys.stderr.close()
        return 0
    except Exception as exc:  # noqa: BLE001 - one line for users, the traceback with --debug
        if args.debug:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"autodeploy: internal error: {type(exc).__name__}: {first} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    configure_cli_logging(args.debug)
    args.argv = argv  # the ranks a tensor-parallel command starts run the same command line
    if extra and not args.accepts_overrides:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return _run(args.func, args, extra, argv)


if __name__ == "__main__":
    sys.exit(main())
