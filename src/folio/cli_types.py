"""argparse pieces shared by every `folio` command.

Value types reject a bad flag while the command line is parsed, before torch
is imported or a model is read (a few milliseconds instead of seconds). The
help formatter shows each flag's default; the parser prints its errors on one
line and can define a subcommand's flags only when that subcommand is used.
Nothing here imports torch: `folio --help` and a rejected flag stay fast.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable, Optional

from folio.sampling_params import INT64_MAX, INT64_MIN   # seeds reach torch as int64


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
    return value


def existing_dir(text: str) -> str:
    """A folder that exists (as given; it is resolved where it is used)."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"no such folder: {text}")
    return text


def port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0..65535)")
    return value


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def power_of_two(text: str) -> int:
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two, got {value}")
    return value


def seed(text: str) -> int:
    value = _int(text)
    if not INT64_MIN <= value <= INT64_MAX:
        raise argparse.ArgumentTypeError(f"must fit in 64 bits ({INT64_MIN}..{INT64_MAX})")
    return value


def top_k(text: str) -> int:
    value = _int(text)
    if not -1 <= value <= INT64_MAX:
        raise argparse.ArgumentTypeError(f"must be -1 or 0 (off) or positive, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def probability(text: str) -> float:
    """A top-p (0 would keep no token at all) or a share of GPU memory: in (0, 1]."""
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def fraction(text: str) -> float:
    """A min-p: in [0, 1]."""
    value = _float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def length_range(text: str) -> tuple[int, int]:
    """'32:384' -> (32, 384), '128' -> (128, 128); 1 <= A <= B."""
    lo, sep, hi = text.partition(":")
    try:
        bounds = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length or a range A:B") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"a length range A:B needs 1 <= A <= B, got {text!r}")
    return bounds


def memory_size(text: str) -> int:
    """Bytes from '4GiB', '512MiB', '2G' or a plain number."""
    from folio.config import parse_size
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class AppendCommaSeparated(argparse.Action):
    """One value per use, repeatable, each use possibly 'a,b'.

    Unlike nargs="*", it never swallows the positional arguments that follow.
    """

    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest, None) or [])
        items.extend(v.strip() for v in values.split(",") if v.strip())
        setattr(namespace, self.dest, items)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends '(default: X)' to a flag's help unless the help already speaks of its default.

    None and empty defaults show nothing: where they mean something ("the
    model's", "off"), the help sentence says so itself. Plain on/off switches
    (store_true) show nothing either: giving the flag is the change.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        # Python 3.9-3.13 BooleanOptionalAction appends its own "(default: True)".
        help_text = help_text.replace(" (default: %(default)s)", "")
        if "default" in help_text or help_text == argparse.SUPPRESS:
            return help_text
        shown = _shown_default(action)
        return help_text if shown is None else f"{help_text} (default: {shown})"


def _shown_default(action: argparse.Action) -> Optional[str]:
    default = action.default
    switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
    if switch or default is None or default is argparse.SUPPRESS or default == []:
        return None
    if isinstance(default, bool):
        text = "on" if default else "off"
    elif isinstance(default, tuple) and len(default) == 2:
        text = f"{default[0]}:{default[1]}"      # a length_range
    else:
        text = str(default)
    return text.replace("%", "%%")       # help strings are %-formatted afterwards


class FolioArgumentParser(argparse.ArgumentParser):
    """Shows defaults in --help, reports a bad flag on one line, and can defer its flags.

    `defer(populate)` postpones `populate(self)` until this parser parses or
    prints help: a benchmark's module (and whatever it comes to import, as
    the throughput one once imported torch) loads only when that benchmark
    is asked for, never for `folio generate --max-tokens -1`.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        self._pending: Optional[Callable[[argparse.ArgumentParser], None]] = None
        # The deepest command parsed overrides this: its name goes in the error.
        self.set_defaults(_prog=self.prog)

    def defer(self, populate: Callable[[argparse.ArgumentParser], None]) -> None:
        self._pending = populate

    def populate(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending(self)

    def parse_known_args(self, args=None, namespace=None):
        self.populate()
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        namespace, extra = self.parse_known_args(args, namespace)
        if extra:       # name the subcommand whose --help lists the flags, not `folio`
            self._fail(namespace._prog, f"unrecognized arguments: {' '.join(extra)}")
        return namespace

    def format_help(self) -> str:
        self.populate()
        return super().format_help()

    def format_usage(self) -> str:
        self.populate()
        return super().format_usage()

    def error(self, message: str):
        # The usage of a command with 30 flags is a screenful that buries the one line that matters.
        self._fail(self.prog, message)

    def _fail(self, prog: str, message: str):
        self.exit(2, f"{prog}: error: {message} (see `{prog} --help`)\n")


def subcommand_parsers(parser: argparse.ArgumentParser, prefix: str = "") -> dict:
    """{'serve': parser, 'bench throughput': parser, ...}: every leaf command, its flags defined."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if isinstance(sub, FolioArgumentParser):
                    sub.populate()
                leaves = subcommand_parsers(sub, f"{prefix}{name} ")
                found.update(leaves or {f"{prefix}{name}": sub})
    return found


def add_command(sub, name: str, help_text: str, func) -> FolioArgumentParser:
    p = sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:])
    if func is not None:
        p.set_defaults(func=func)
    return p
