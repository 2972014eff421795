"""Every benchmark script under docs/bench and every helper under scripts/ that
guards its work behind `if __name__ == "__main__"` imports cleanly: a rename
in Folio that a script still uses by its old name fails here, not months
later when someone reruns a figure of docs/benchmarks.md."""

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for d in ("docs/bench", "scripts") for p in (ROOT / d).glob("*.py")
                 if 'if __name__ == "__main__":' in p.read_text())


def test_the_scripts_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"linear_bf16w.py", "threads.py", "cpu_baselines.py"} <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_script_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(path.parent))     # scripts import their neighbours
    name = f"_folio_script_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    assert module.__doc__, "a script says in its docstring how it is run"
