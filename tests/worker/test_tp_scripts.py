"""Tensor parallelism from a user's script: spawned workers must not run the
script again. Without the guard they used to re-run `LLM(...)` at module level
and the parent waited 60 s for ranks that never joined."""

import os
import subprocess
import sys
import textwrap

import pytest

from folio import LLM, SamplingParams
from tests.utils import make_tiny_model

PROMPT = [1, 20, 30, 40, 50]
BODY = """
from folio import LLM, SamplingParams
print("script ran", flush=True)     # the workers must not print this again
{indent}llm = LLM({model!r}, dtype="float32", num_kv_blocks=32, tensor_parallel_size=2)
{indent}out = llm.generate([{{"prompt_token_ids": {prompt!r}}}],
{indent}                   SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
{indent}                   use_tqdm=False)
{indent}print("TOKENS", out[0].outputs[0].token_ids, flush=True)
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tp-script"))


def expected_tokens(tiny) -> list[int]:
    out = LLM(tiny, dtype="float32", num_kv_blocks=32).generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=6,
                                                       ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].token_ids


def script(tiny, guarded: bool) -> str:
    body = BODY.format(model=tiny, prompt=PROMPT, indent="    " if guarded else "")
    if guarded:
        head, rest = body.split('print("script ran", flush=True)', 1)
        body = head + 'print("script ran", flush=True)\nif __name__ == "__main__":' + rest
    return textwrap.dedent(body)


@pytest.mark.parametrize("guarded", [False, True])
@pytest.mark.parametrize("as_module", [False, True])
def test_script_with_and_without_main_guard(tiny, tmp_path, guarded, as_module):
    (tmp_path / "user_script.py").write_text(script(tiny, guarded))
    cmd = [sys.executable] + (["-m", "user_script"] if as_module else ["user_script.py"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), str(tmp_path)])}
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("script ran") == 1, run.stdout
    assert f"TOKENS {expected_tokens(tiny)}" in run.stdout
