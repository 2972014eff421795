"""No request can hurt the server: a battery of hostile requests over HTTP.

Each one must be answered with a 4xx in OpenAI's error shape, or a 200 (a
stream's events holding no 5xx error), and /health must still be 200 after
it. Bodies are sent as raw bytes where they hold what json.dumps would not
write on purpose: NaN and Infinity literals (Python's JSON parser takes them),
integers of thousands of digits, bytes that are not UTF-8.
"""

import json

import pytest

from tests.server.conftest import ServerProcess, http, tiny_server_args
from tests.server.test_lifecycle import metrics

CMPL = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BEAM = {**CMPL, "use_beam_search": True, "n": 2, "best_of": 2}
C, H, T, D = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
FLOATS = ["temperature", "top_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "min_p"]
BIG = [2**70, -2**70, 2**63, 2**63 - 1, -2**63 - 1]


def with_literal(base: dict, name: str, literal: str) -> bytes:
    """`base` plus `"name": literal`, written by hand (NaN, Infinity, huge numbers)."""
    return (json.dumps(base)[:-1] + f', "{name}": {literal}}}').encode()


def cases() -> list:
    out = []

    def add(path, body, label):
        out.append(pytest.param(path, body, id=label))

    # NaN and Infinity in every float field, on both endpoints
    for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
        for name in FLOATS:
            add(C, with_literal(CMPL, name, literal), f"cmpl-{name}-{literal}")
            add(H, with_literal(CHAT, name, literal), f"chat-{name}-{literal}")
        add(C, with_literal(BEAM, "length_penalty", literal), f"beam-length_penalty-{literal}")
        add(C, with_literal(CMPL, "logit_bias", f'{{"5": {literal}}}'), f"logit_bias-{literal}")
        add(C, with_literal(CMPL, "seed", literal), f"seed-{literal}")
        add(C, with_literal(CMPL, "max_tokens", literal), f"max_tokens-{literal}")
    # integers past int64, at its edges, and of thousands of digits
    for value in BIG:
        for name in ("seed", "top_k", "max_tokens", "priority", "n", "best_of", "logprobs",
                     "min_tokens"):
            add(C, {**CMPL, name: value}, f"cmpl-{name}-{value}")
        for name in ("seed", "max_completion_tokens", "top_logprobs", "priority"):
            add(H, {**CHAT, name: value, "logprobs": True}, f"chat-{name}-{value}")
        add(C, {**CMPL, "stop_token_ids": [value]}, f"stop_token_ids-{value}")
        add(C, {**CMPL, "prompt": [1, value]}, f"prompt-id-{value}")
        add(C, {**CMPL, "prompt": [[1], [value]]}, f"prompt-ids-{value}")
        add(D, {"tokens": [value]}, f"detokenize-{value}")
        add(C, {**CMPL, "logit_bias": {str(value): 1}}, f"logit_bias-key-{value}")
        add(C, {**BEAM, "best_of": value}, f"beam-best_of-{value}")
    add(C, {**CMPL, "seed": 2**63 - 1, "n": 2, "temperature": 1}, "seed-plus-n-overflows")
    add(C, {**CMPL, "seed": -2**63, "n": 3}, "seed-int64-min")
    add(C, {**CMPL, "n": 2**40}, "n-2**40")
    add(C, with_literal(CMPL, "seed", "9" * 5000), "seed-5000-digits")
    add(C, with_literal(CMPL, "temperature", "1" + "0" * 400 + ".5"), "temperature-400-digits")
    # finite extremes of floats
    for name, value in (("temperature", 1e308), ("temperature", 5e-324), ("top_p", 5e-324),
                        ("repetition_penalty", 1e308), ("repetition_penalty", 5e-324),
                        ("min_p", 1.0), ("presence_penalty", -2.0), ("frequency_penalty", 2.0)):
        add(C, {**CMPL, name: value}, f"{name}-{value}")
    for value in (1e308, -1e308, 100.0, -100.0):
        add(C, {**CMPL, "logit_bias": {"5": value}}, f"logit_bias-value-{value}")
    add(C, {**CMPL, "logit_bias": {"99999999999999999999": 1}}, "logit_bias-key-20-nines")
    add(C, {**CMPL, "logit_bias": {"-1": 1}}, "logit_bias-negative-key")
    add(C, {**CMPL, "logit_bias": {"1e3": 1}}, "logit_bias-float-key")
    add(C, {**CMPL, "logit_bias": {str(i): 1 for i in range(384)}}, "logit_bias-every-token")
    add(C, {**BEAM, "length_penalty": 1e308}, "beam-length_penalty-huge")
    add(C, {**BEAM, "length_penalty": -1e308}, "beam-length_penalty-negative-huge")
    add(C, {**CMPL, "prompt": [1, 384]}, "prompt-id-vocab-size")
    add(C, {**CMPL, "prompt": [-1]}, "prompt-id-negative")
    add(D, {"tokens": [-1, 384]}, "detokenize-outside")
    # empty and nested-empty
    for prompt in ([], [[]], [[], [1]], [""], ["", "x"], [[1], []], "", " "):
        add(C, {**CMPL, "prompt": prompt}, f"prompt-{json.dumps(prompt)}")
    add(D, {"tokens": []}, "detokenize-empty")
    add(T, {"prompt": ""}, "tokenize-empty")
    add(T, {}, "tokenize-nothing")
    add(H, {**CHAT, "messages": []}, "messages-empty")
    # stop strings: many, huge, odd
    add(C, {**CMPL, "stop": [f"s{i}" for i in range(5000)]}, "stop-5000")
    add(H, {**CHAT, "stop": [f"s{i}" for i in range(5000)]}, "chat-stop-5000")
    add(C, {**CMPL, "stop": "x" * 100_000}, "stop-100k-chars")
    add(C, {**CMPL, "stop": "x" * 100_000, "stream": True}, "stop-100k-chars-stream")
    add(C, {**CMPL, "stop": ["\u0000", "\ud800", "🙂"]}, "stop-odd-characters")
    add(C, {**CMPL, "stop_token_ids": list(range(384))}, "stop-every-token")
    # chat-template tricks, sent as the request's chat_template
    for label, template in (
            ("range", "{% for i in range(10**9) %}x{% endfor %}"),
            ("nested-range", "{% for i in range(99999) %}{% for j in range(2) %}{% endfor %}"
                             "{% endfor %}ok"),
            ("string-times-huge", "{{ 'x' * 10**12 }}"),
            ("center-huge", "{{ 'x' | center(10**12) }}"),
            ("recursion", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"),
            ("raise_exception", "{{ raise_exception('no') }}"),
            ("cycler", "{% set c = cycler(*range(1000)) %}{{ c.next() }}{{ c.__class__ }}"),
            ("namespace", "{% set ns = namespace(a=1) %}{% set ns.__class__ = 1 %}{{ ns }}"),
            ("namespace-dunder", "{% set ns = namespace() %}{{ ns.__init__.__globals__ }}"),
            ("class", "{{ ''.__class__.__mro__[1].__subclasses__() }}"),
            ("messages-class", "{{ messages.__class__.__base__ }}"),
            ("attr-filter", "{{ messages | attr('__class__') }}"),
            ("format", "{{ '%s' | format(messages.__class__) }}"),
            ("str-format", "{{ '{0.__class__}'.format(messages) }}"),
            ("syntax-error", "{% for %}"),
            ("unclosed", "{% if true %}"),
            ("undefined-filter", "{{ 'a' | no_such_filter }}"),
            ("undefined-test", "{% if 1 is no_such_test %}{% endif %}"),
            ("division-by-zero", "{{ 1 / 0 }}"),
            ("index-error", "{{ messages[99]['content'] }}"),
            ("pop", "{{ messages.pop() }}"),
            ("append", "{{ messages.append(1) }}"),
            ("loop-controls", "{% for m in messages %}{% break %}{% endfor %}ok"),
            ("import", "{% import 'x' as x %}"),
            ("include", "{% include '/etc/passwd' %}"),
            ("extends", "{% extends 'base' %}"),
            ("int-of-string", "{{ 'abc' | int(base=99) }}"),
            ("empty", ""),
    ):
        add(H, {**CHAT, "chat_template": template}, f"template-{label}")
        add(T, {"messages": CHAT["messages"], "chat_template": template},
            f"tokenize-template-{label}")
    add(H, {**CHAT, "chat_template": 5}, "template-number")
    add(H, {**CHAT, "chat_template_kwargs": {"add_generation_prompt": "x"}}, "kwargs-wrong-type")
    add(H, {**CHAT, "chat_template_kwargs": {"messages": []}}, "kwargs-messages")
    add(H, {**CHAT, "chat_template_kwargs": {"special_tokens": 1}}, "kwargs-special_tokens")
    add(H, {**CHAT, "chat_template_kwargs": {"template": "x"}}, "kwargs-template")
    add(H, {**CHAT, "chat_template_kwargs": {"chat_template": 5}}, "kwargs-chat_template")
    add(H, {**CHAT, "chat_template_kwargs": {"bos_token": None, "": 1}}, "kwargs-odd-names")
    add(H, {**CHAT, "chat_template_kwargs": [1]}, "kwargs-a-list")
    # odd message shapes
    deep = "x"
    for _ in range(200):
        deep = {"a": deep}
    for label, messages in (
            ("empty-dict", [{}]), ("role-number", [{"role": 5}]), ("role-only", [{"role": "user"}]),
            ("content-null", [{"role": "user", "content": None}]),
            ("content-number", [{"role": "user", "content": 5}]),
            ("content-float", [{"role": "user", "content": 1.5}]),
            ("content-dict", [{"role": "user", "content": {"a": 1}}]),
            ("content-image", [{"role": "user", "content": [{"type": "image_url",
                                                             "image_url": {"url": "x"}}]}]),
            ("content-list-of-lists", [{"role": "user", "content": [[1, 2], [3]]}]),
            ("content-part-no-type", [{"role": "user", "content": [{"text": "x"}]}]),
            ("content-part-text-null", [{"role": "user", "content": [{"type": "text",
                                                                      "text": None}]}]),
            ("content-deep", [{"role": "user", "content": deep}]),
            ("content-empty-list", [{"role": "user", "content": []}]),
            ("list-in-list", [[{"role": "user", "content": "x"}]]),
            ("null", [None]), ("number", [1]), ("string", ["hi"]),
            ("tool-calls-odd", [{"role": "assistant", "content": "x",
                                 "tool_calls": [{"function": {"arguments": "{bad"}}, 5]}]),
            ("long-role", [{"role": "r" * 100_000, "content": "x"}]),
    ):
        add(H, {**CHAT, "messages": messages}, f"messages-{label}")
        add(T, {"messages": messages}, f"tokenize-messages-{label}")
    add(H, {**CHAT, "continue_final_message": True,
            "messages": [{"role": "user", "content": [1]}]}, "continue-final-odd")
    add(H, {**CHAT, "continue_final_message": True, "add_generation_prompt": True},
        "continue-final-and-generation-prompt")
    # wrong types everywhere
    for name, value in (("temperature", "hot"), ("top_p", [1]), ("n", "2"), ("n", 1.5),
                        ("stream", "yes"), ("stop", 5), ("stop", [1]), ("stop", [[]]),
                        ("logit_bias", [1]), ("logit_bias", {"5": "x"}), ("max_tokens", True),
                        ("max_tokens", 1.5), ("echo", "x"), ("stream_options", "x"),
                        ("stream_options", {"include_usage": "maybe"}), ("seed", "abc"),
                        ("priority", 1.5), ("model", 5), ("user", 5), ("best_of", "x"),
                        ("early_stopping", "sometimes"), ("logprobs", -1), ("top_k", -2),
                        ("prompt", {"a": 1}), ("prompt", [1.5]), ("prompt", [True]),
                        ("prompt", None), ("ignore_eos", None), ("stop_token_ids", "1")):
        add(C, {**CMPL, name: value}, f"cmpl-type-{name}-{json.dumps(value)}")
    for name, value in (("messages", "hi"), ("messages", {"role": "user"}), ("logprobs", 5),
                        ("top_logprobs", -1), ("add_generation_prompt", "x"),
                        ("max_completion_tokens", "x"), ("echo", 1)):
        add(H, {**CHAT, name: value}, f"chat-type-{name}-{json.dumps(value)}")
    # the same, streamed: an error found once the stream began must not be a 5xx event
    for label, body in (("seed-plus-n", {**CMPL, "seed": 2**63 - 1, "n": 2}),
                        ("top_k-int64-max", {**CMPL, "top_k": 2**63 - 1}),
                        ("logit_bias-key", {**CMPL, "logit_bias": {str(2**70): 1}}),
                        ("stop-5000", {**CMPL, "stop": [f"s{i}" for i in range(5000)]}),
                        ("prompt-ids", {**CMPL, "prompt": [[1], [2**63]]})):
        add(C, {**body, "stream": True}, f"stream-{label}")
    for label, body in (("template-range", {**CHAT, "chat_template": "{{ range(10**9) }}"}),
                        ("seed-plus-n", {**CHAT, "seed": 2**63 - 1, "n": 2}),
                        ("messages-odd", {**CHAT, "messages": [{"role": 5}]})):
        add(H, {**body, "stream": True}, f"chat-stream-{label}")
    add(C, with_literal({**CMPL, "stream": True}, "temperature", "NaN"), "stream-temperature-NaN")
    # bodies that are not what they claim
    for label, raw in (("not-json", b"{not json"), ("empty", b""), ("array", b"[1, 2]"),
                       ("null", b"null"), ("string", b'"hi"'), ("number", b"5"),
                       ("deep", b"[" * 100_000 + b"]" * 100_000),
                       ("deep-object", b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
                       ("not-utf8", b'{"prompt": "\xff\xfe"}'), ("bom", b"\xef\xbb\xbf{}"),
                       ("duplicate-keys", b'{"prompt": 1, "prompt": "x", "max_tokens": 2}'),
                       ("trailing", b'{"prompt": "x"} trailing')):
        add(C, raw, f"body-{label}")
        add(H, raw, f"chat-body-{label}")
    # issue 52: text that is not Unicode, roles no chat has, constraints with no way on
    for label, raw in (("surrogate-prompt", b'{"prompt": "a\\ud800", "max_tokens": 2}'),
                       ("surrogate-stop", b'{"prompt": "a", "stop": ["\\udfff"]}'),
                       ("surrogate-key", b'{"prompt": "a", "\\ud800": 1}')):
        add(C, raw, f"raw-{label}")
    add(H, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "raw-chat-surrogate")
    for role in ("hacker", "", "SYSTEM"):
        add(H, {**CHAT, "messages": [{"role": role, "content": "x"}]}, f"chat-role-{role}")
    recursive = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#"}}}
    add(H, {**CHAT, "response_format": recursive}, "chat-schema-ref-self")
    for stream in (False, True):
        add(C, {**CMPL, "max_tokens": 20, "min_tokens": 16, "stream": stream,
                "structured_outputs": {"regex": "a"}}, f"regex-dead-end-stream-{stream}")
    return out


def no_server_error_in(answer) -> bool:
    """A 200 stream may carry an error event: it must not be a 5xx either."""
    if not isinstance(answer, str):
        return True
    for line in answer.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[len("data: "):])
            if "error" in event and event["error"]["code"] >= 500:
                return False
    return True


class Restarting:
    """The battery's server, started again if a case ended it: one case that stops
    the server fails alone, and every other case still gets its own verdict."""

    def __init__(self, model: str):
        self.model, self.logs = model, []
        self.srv = ServerProcess(tiny_server_args(model))

    def get(self) -> ServerProcess:
        if not self._healthy():
            try:
                self.srv.proc.wait(60)      # a dead engine ends the process: let it finish
            finally:
                self.srv.stop()
            self.logs.append(self.srv.output())
            self.srv = ServerProcess(tiny_server_args(self.model))
        return self.srv

    def _healthy(self) -> bool:
        try:
            return http("GET", self.srv.url + "/health")[0] == 200
        except OSError:
            return False


@pytest.fixture(scope="module")
def battery(tiny_model, request):
    holder = Restarting(tiny_model)
    yield holder
    holder.srv.stop()
    if request.session.testsfailed:
        print("---- server logs ----", *holder.logs, holder.srv.output(), sep="\n")


@pytest.mark.parametrize("path,body", cases())
def test_a_hostile_request_gets_a_4xx_or_a_200_and_the_server_stays_healthy(battery, path,
                                                                            body):
    server = battery.get()
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, answer = http("POST", server.url + path, raw=data)
    assert status == 200 or 400 <= status < 500, answer
    if status == 200:
        assert no_server_error_in(answer), answer
    else:
        assert set(answer["error"]) == {"message", "type", "param", "code"}, answer
        assert answer["error"]["code"] == status and answer["error"]["message"]
        assert answer["error"]["type"] == "invalid_request_error" or status == 404
    assert http("GET", server.url + "/health")[0] == 200


def test_after_the_battery_a_good_request_runs_and_every_block_is_free(battery):
    server = battery.get()
    status, _, out = http("POST", server.url + C, {**CMPL, "max_tokens": 4, "ignore_eos": True})
    assert status == 200 and out["usage"]["completion_tokens"] == 4
    m = metrics(server)
    assert m["folio:num_requests_running"] == 0 and m["folio:kv_cache_usage_perc"] == 0.0
