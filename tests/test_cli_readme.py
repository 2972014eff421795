"""The README's command paragraphs and the parsers agree, flag for flag.

A command's flags are told in its own paragraph (the one that starts with
`folio COMMAND`) and in the shared "Engine flags" and "Sampling flags"
paragraphs; each parser flag must be named in one of them (aliases and
`--no-` forms may go unsaid), and each flag they name must exist in every
command they speak for.
"""

import re
from pathlib import Path

import pytest

from folio.cli import build_parser
from folio.cli_types import subcommand_parsers

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the reference pages the README links, where the commands' paragraphs live
PAGES = [README] + [ROOT / "docs" / f"{name}.md" for name in
                    ("models", "offline", "serving", "scaling", "command-line", "deployment")]

# command -> (the start of its own paragraph, the shared paragraphs it takes)
COMMANDS = {
    "serve": ("`folio serve` flags", ("Engine flags", )),
    "generate": ("`folio generate`", ("Engine flags", "Sampling flags")),
    "chat": ("`folio chat`", ("Engine flags", "Sampling flags")),
    "bench throughput": ("`folio bench throughput`", ("Engine flags", )),
    "bench serve": ("`folio bench serve`", ()),
    "bench memory": ("`folio bench memory`", ("Engine flags", )),
    "bench weights": ("`folio bench weights`", ("Engine flags", )),
    "bench embeddings": ("`folio bench embeddings`", ("Engine flags", )),
    "bench gpu": ("`folio bench gpu`", ()),
    "bench host": ("`folio bench host`", ()),
    "bench autoscale": ("`folio bench autoscale`", ()),
    "env": ("`folio env`", ()),
    "usage": ("`folio usage`", ()),
    "plan": ("`folio plan`", ()),
}


def paragraph(start: str) -> str:
    text = "\n\n".join(page.read_text() for page in PAGES)
    found = [p for p in re.split(r"\n\s*\n", text) if p.startswith(start)]
    assert len(found) == 1, f"the README's pages need one paragraph starting with {start!r}"
    return " ".join(found[0].split())


def named_flags(text: str) -> set[str]:
    """Flags written in `code` spans: `--port`, `--input-len A:B`, (`-tp`)."""
    spans = re.findall(r"`([^`]*)`", text)
    return {flag for span in spans for flag in re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", span)}


def parser_flags(parser) -> set[str]:
    """Every spelling, aliases and --no- forms included."""
    return {o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")}


def canonical_flags(parser) -> set[str]:
    """One spelling a flag: its first (`--num-kv-blocks`, `--ignore-eos`, not `--no-ignore-eos`)."""
    return {a.option_strings[0] for a in parser._actions
            if a.option_strings and a.option_strings[0] not in ("-h", "--help")}


@pytest.fixture(scope="module")
def parsers():
    return subcommand_parsers(build_parser())


def test_the_table_covers_every_command(parsers):
    assert set(parsers) == set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_the_command_is_in_the_readme(command, parsers):
    own, shared = COMMANDS[command]
    told = named_flags(paragraph(own)).union(*(named_flags(paragraph(s)) for s in shared))
    missing = sorted(canonical_flags(parsers[command]) - told)
    assert not missing, f"folio {command}: flags the README does not mention: {missing}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_the_readme_names_exists(command, parsers):
    own, _ = COMMANDS[command]
    unknown = sorted(named_flags(paragraph(own)) - parser_flags(parsers[command]))
    assert not unknown, f"the README names flags that folio {command} lacks: {unknown}"


@pytest.mark.parametrize("shared", ["Engine flags", "Sampling flags"])
def test_the_shared_flags_exist_in_every_command_that_takes_them(shared, parsers):
    takers = [c for c, (_, paragraphs) in COMMANDS.items() if shared in paragraphs]
    for command in takers:
        unknown = sorted(named_flags(paragraph(shared)) - parser_flags(parsers[command]))
        assert not unknown, f"{shared!r} names flags that folio {command} lacks: {unknown}"


def test_the_commands_taking_engine_flags_are_those_the_readme_says(parsers):
    takers = {c for c, (_, paragraphs) in COMMANDS.items() if "Engine flags" in paragraphs}
    with_engine = {c for c, p in parsers.items() if "--block-size" in parser_flags(p)}
    assert with_engine == takers
    lead = paragraph("Engine flags").split(":")[0]
    assert all(f"`{c}`" in lead for c in takers) and "not by `bench serve`" in lead


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_readmes_links_reach_their_pages_and_sections():
    text = README.read_text()
    links = re.findall(r"\]\((docs/[\w.-]+\.md)(?:#([\w-]+))?\)", text)
    assert len(links) >= 10
    for path, anchor in links:
        page = ROOT / path
        assert page.is_file(), path
        if anchor:
            headings = re.findall(r"^#+ (.*)$", page.read_text(), re.M)
            assert anchor in {_anchor(h) for h in headings}, (path, anchor)


def test_the_readmes_first_request_runs_as_written(capsys):
    """The README's python, the default model offline, as a newcomer pastes it."""
    [code] = re.findall(r"^```python\n(.*?)^```$", README.read_text(), re.S | re.M)
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out.strip()
