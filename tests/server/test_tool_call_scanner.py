"""The scanner that reads a forced tool call's text as it grows
(server/tools.py's CallScanner and ForcedCallStream): every prefix of an
answer gives a result consistent with the whole one, the streamed arguments
join into the unstreamed ones, and an answer cut short keeps the calls it
completed."""

import json

import pytest

from folio.server.tools import CallScanner, ForcedCallStream, NamedToolChoice, forced_calls

CALLS = [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}},
         {"name": "book_table", "arguments": {"restaurant": 'Luigi\'s "best" [x] {y}\\',
                                              "people": 12}},
         {"name": "we\"ird\\name", "arguments": {"deep": [1, [2, {"a": {"b": []}}], -3.5e2],
                                                 "t": True, "n": None, "u": "é\u2028\\u00e9"}},
         {"name": "noargs", "arguments": {}}]

TEXTS = {
    # as the grammar writes them: compact, in schema order
    "compact": json.dumps(CALLS, ensure_ascii=False),
    "ascii": json.dumps(CALLS),
    "blanks": json.dumps(CALLS, indent=2),
    "tight": json.dumps(CALLS, separators=(",", ":")),
    "arguments first": json.dumps([{"arguments": c["arguments"], "name": c["name"]}
                                   for c in CALLS]),
    "number last": json.dumps([{"name": "f", "arguments": {"n": 10}},
                               {"name": "g", "arguments": {"n": -0.5}}]),
}
NAMED = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})


def scanned(scanner, text):
    return [(c.name, scanner.arguments(text, c), c.done) for c in scanner.calls]


def whole(text, function=None):
    s = CallScanner(function)
    s.end(text)
    return s


@pytest.mark.parametrize("kind", TEXTS)
def test_the_whole_text_gives_each_call_and_its_arguments_as_written(kind):
    text = TEXTS[kind]
    s = whole(text)
    assert s.complete
    got = scanned(s, text)
    assert [(n, json.loads(a), d) for n, a, d in got] == \
        [(c["name"], c["arguments"], True) for c in json.loads(text)]
    # the arguments are the very characters generated, not a re-serialisation
    assert all(a in text for _, a, _ in got)


@pytest.mark.parametrize("kind", TEXTS)
def test_every_prefix_is_consistent_with_the_whole_and_grows(kind):
    text = TEXTS[kind]
    final = scanned(whole(text), text)
    growing = CallScanner()
    before = []
    for n in range(len(text) + 1):
        prefix = text[:n]
        fresh = CallScanner()
        fresh.feed(prefix)
        growing.feed(prefix)
        now = scanned(fresh, prefix)
        assert now == scanned(growing, prefix), n       # fed at once or bit by bit: the same
        assert len(now) >= len(before)
        for i, (name, arguments, done) in enumerate(now):
            f_name, f_arguments, _ = final[i]
            assert name in (None, f_name) and f_arguments.startswith(arguments), (n, i)
            if i < len(before):
                b_name, b_arguments, b_done = before[i]
                assert arguments.startswith(b_arguments) and (b_name is None or name == b_name)
                assert done or not b_done
            if done:
                assert (name, arguments) == final[i][:2]
        assert fresh.complete == (n == len(text))       # each text ends with its "]"
        before = now


@pytest.mark.parametrize("kind", TEXTS)
def test_a_cut_answer_keeps_the_calls_it_completed(kind):
    text = TEXTS[kind]
    final = scanned(whole(text), text)
    for n in range(len(text)):
        calls, finish = forced_calls(text[:n], "required", "length")
        assert finish == "length"
        got = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert got == [f[:2] for f in final[:len(got)]]
        # a call is kept once its object closed, not before
        closed = whole(text[:n]).calls
        assert len(got) == sum(c.done for c in closed)
    calls, finish = forced_calls(text, "required", "stop")
    assert finish == "tool_calls" and len(calls) == len(final)
    assert forced_calls(text[:len(text) // 2], "required", "stop")[1] == "stop"  # a stop string


@pytest.mark.parametrize("kind", TEXTS)
def test_streamed_deltas_join_into_the_unstreamed_calls(kind):
    text = TEXTS[kind]
    expected, _ = forced_calls(text, "required", "stop")
    for step in (1, 3, 7):
        stream, entries = ForcedCallStream("required"), []
        for n in list(range(0, len(text), step)) + [len(text)]:
            entries += stream.deltas(text[:n], n == len(text))
        joined, ids = {}, {}
        for e in entries:
            if "id" in e:       # a call's first delta: its id, type and name, no arguments yet
                assert e["index"] == len(joined) and e["type"] == "function"
                assert e["function"]["arguments"] == "" and e["function"]["name"]
                joined[e["index"]] = [e["function"]["name"], ""]
                ids[e["index"]] = e["id"]
            else:
                assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
                assert e["function"]["arguments"]
                joined[e["index"]][1] += e["function"]["arguments"]
        assert [tuple(joined[i]) for i in sorted(joined)] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in expected]
        assert len(set(ids.values())) == len(ids) and all(i.startswith("call_")
                                                          for i in ids.values())
        assert stream.scanner.complete


def test_a_named_function_is_the_whole_text():
    text = '{"city": "Os\\"lo", "unit": "celsius"}'
    calls, finish = forced_calls(text, NAMED, "stop")
    assert finish == "tool_calls" and [(c["function"]["name"], c["function"]["arguments"])
                                       for c in calls] == [("get_weather", text)]
    assert forced_calls(text[:-1], NAMED, "length") == ([], "length")   # cut: no call
    stream = ForcedCallStream(NAMED)
    first = stream.deltas("", False)
    assert first == [{"index": 0, "id": first[0]["id"], "type": "function",
                      "function": {"name": "get_weather", "arguments": ""}}]
    pieces = [stream.deltas(text[:n], n == len(text)) for n in range(1, len(text) + 1)]
    assert all(len(p) == 1 and set(p[0]) == {"index", "function"} for p in pieces)
    assert "".join(p[0]["function"]["arguments"] for p in pieces) == text
    assert whole("42", "f").calls[0].done           # a number ends where the text does


def test_the_scanner_ignores_a_shorter_text_and_what_follows_the_answer():
    s = CallScanner()
    s.feed('[{"name": "a", "arguments": {"x": 1}}]')
    s.feed('[{"na')                                  # held back by a stream: nothing undone
    assert s.complete and s.calls[0].done and s.calls[0].name == "a"
    s = CallScanner()
    s.end('[{"name": "a", "arguments": {}}]  ]}"')
    assert s.complete and len(s.calls) == 1
