"""Argument types of `folio bench` beyond the shared ones in folio.cli_types
(length ranges, positive counts): a bad rate, URL, SLO or path fails while the
command line is parsed, before a model loads or a request is sent.

Plain Python on purpose: `folio --help` builds every parser, and must not wait
for torch.
"""

from __future__ import annotations

import argparse
import math
import os
import urllib.parse
from typing import Callable


def checked(parse: Callable, name: str) -> Callable:
    """`parse` as an argparse type: its ValueError becomes the usage error
    (argparse would otherwise print only "invalid <name> value")."""
    def check(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    check.__name__ = name
    return check


def _rate(text: str) -> float:
    """A request rate: a positive number of requests per second, or 'inf'."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected requests per second or 'inf', got {text!r}") from None
    if math.isnan(value) or value <= 0:
        raise ValueError(f"a request rate must be > 0 (or 'inf'), got {text!r}")
    return value


def _rates(text: str) -> list[float]:
    parts = [p.strip() for p in str(text).split(",")]
    if not all(parts):
        raise ValueError(f"expected comma-separated rates such as 1,2,4,inf, got {text!r}")
    return [_rate(p) for p in parts]


def _http_url(text: str) -> str:
    url = urllib.parse.urlsplit(text)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ValueError(f"expected a URL such as http://127.0.0.1:8000, got {text!r}")
    return text.rstrip("/")


def _dataset(text: str) -> str:
    if text != "random" and not os.path.isfile(text):
        raise ValueError(f"expected 'random' or a JSONL file, and there is no file {text!r}")
    return text


def _existing_file(text: str) -> str:
    if not os.path.isfile(text):
        raise ValueError(f"no such file: {text!r}")
    return text


def _output_path(text: str) -> str:
    # Checked up front: a sweep that runs for minutes must not fail at its last write.
    folder = os.path.dirname(text) or "."
    if not os.path.isdir(folder):
        raise ValueError(f"the folder {folder!r} does not exist")
    return text


request_rate = checked(_rate, "request rate")
request_rates = checked(_rates, "request rates")
http_url = checked(_http_url, "URL")
dataset = checked(_dataset, "dataset")
existing_file = checked(_existing_file, "file")
output_path = checked(_output_path, "output path")


def format_range(lengths: tuple[int, int]) -> str:
    """(32, 384) -> '32:384', (7, 7) -> '7': the form the flags take."""
    lo, hi = lengths
    return str(lo) if lo == hi else f"{lo}:{hi}"


def write_result(args, result: dict) -> bool:
    """--save-result FILE and --json, as every benchmark that has them does them:
    True when the result went to stdout as JSON (so no table follows)."""
    import json
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    if args.json:
        print(json.dumps(result))
    return bool(args.json)
