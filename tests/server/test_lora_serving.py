"""LoRA adapters served (issue 31), through the official `openai` client:
`--lora-modules` at start-up, `/v1/models` listing adapters under the base,
a request picking one by `model` (its text the offline engine's with that
adapter, itself held to transformers + peft in tests/engine/test_lora.py),
and the load, generate, unload flow; what is refused."""

import os

import pytest

from folio import LLM, LoRARequest, SamplingParams
from tests.server.conftest import ServerProcess, http, tiny_server_args
from tests.utils import make_lora_adapter, make_tiny_model

PROMPT = "the cat sat on"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("served_lora")
    base = make_tiny_model(root / "base", max_position_embeddings=256)
    a, _ = make_lora_adapter(base, root / "a", seed=1, r=8, lora_alpha=16,
                             target_modules=["q_proj", "v_proj", "down_proj"])
    b, _ = make_lora_adapter(base, root / "b", seed=2, r=4, lora_alpha=8,
                             target_modules=["o_proj", "gate_proj"])
    srv = ServerProcess(tiny_server_args(base) + ["--enable-lora", "--max-loras", "2",
                                                  "--lora-modules", f"a={a}",
                                                  "--enable-runtime-lora",
                                                  "--lora-root", str(root)])
    yield base, a, b, srv
    srv.stop()


def _offline(base, lora, max_tokens=8):
    llm = LLM(base, dtype="float32", num_kv_blocks=32, enable_lora=True)
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens,
                                               ignore_eos=True),
                        lora_request=lora, use_tqdm=False)[0].outputs[0].text


def test_load_list_generate_unload_with_the_openai_client(setup):
    from openai import BadRequestError, NotFoundError, OpenAI
    base, a, b, srv = setup
    client = OpenAI(base_url=srv.url + "/v1", api_key="none")
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "a"}
    assert models["a"].parent == "tiny" and models["a"].root == a

    def complete(model):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True}
                                         ).choices[0].text
    texts = {name: complete(name) for name in ("tiny", "a")}
    assert texts["a"] == _offline(base, LoRARequest("a", 1, a)) != texts["tiny"]
    chat = client.chat.completions.create(model="a", max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.model == "a" and chat.choices[0].message.content is not None
    # load b while serving, use it, unload it
    status, _, body = http("POST", srv.url + "/v1/load_lora_adapter",
                           {"lora_name": "b", "lora_path": b})
    assert status == 200 and "added successfully" in body
    assert {m.id for m in client.models.list().data} == {"tiny", "a", "b"}
    assert complete("b") == _offline(base, LoRARequest("b", 1, b))
    status, _, body = http("POST", srv.url + "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 200 and "removed successfully" in body
    with pytest.raises(NotFoundError, match="The model `b` does not exist"):
        complete("b")
    # refused: an unknown adapter, one loaded twice, a path without one
    status, _, _ = http("POST", srv.url + "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert status == 404
    for body, message in [({"lora_name": "a", "lora_path": a}, "already served"),
                          ({"lora_name": "c", "lora_path": base}, "no adapter_config.json"),
                          ({"lora_name": "c"}, "lora_path")]:
        status, _, got = http("POST", srv.url + "/v1/load_lora_adapter", body)
        assert status == 400 and message in got["error"]["message"], got
    with pytest.raises(BadRequestError):
        client.completions.create(model="a", prompt=PROMPT, max_tokens=-1)
    assert "a" in {m.id for m in client.models.list().data}


def test_a_server_without_runtime_lora_refuses_to_load(tiny_model, tmp_path):
    """Loading while serving is off by default, --enable-lora or not."""
    a, _ = make_lora_adapter(tiny_model, tmp_path / "a", r=4, lora_alpha=8,
                             target_modules=["q_proj"])
    for extra in ([], ["--enable-lora"]):
        srv = ServerProcess(tiny_server_args(tiny_model) + extra)
        try:
            for path, body in (("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": a}),
                               ("/v1/unload_lora_adapter", {"lora_name": "a"})):
                status, _, got = http("POST", srv.url + path, body)
                assert status == 403, got
                assert "--enable-runtime-lora" in got["error"]["message"]
                assert a not in got["error"]["message"]
            assert [m["id"] for m in http("GET", srv.url + "/v1/models")[2]["data"]] == ["tiny"]
        finally:
            srv.stop()


def test_a_key_limited_to_adapters_sees_only_those_and_its_usage_names_them(setup, tmp_path):
    """`"adapters"` in the keys file: a tenant's key lists and uses only its
    adapters (another is 404, as if it were not there; the base model stays
    open); the ledger, GET /v1/usage?by=adapter and the per-tenant metrics
    record the adapter each request named; loading needs an admin key."""
    import json
    import sqlite3

    from openai import NotFoundError, OpenAI
    base, a, b, _ = setup
    keys = {"keys": [{"key": "sk-a", "tenant": "team-a", "adapters": ["a"]},
                     {"key": "sk-none", "tenant": "team-n", "adapters": []},
                     {"key": "sk-ops", "tenant": "ops", "admin": True}]}
    (tmp_path / "keys.json").write_text(json.dumps(keys))
    db = str(tmp_path / "usage.db")
    srv = ServerProcess(tiny_server_args(base) + [
        "--enable-lora", "--lora-modules", f"a={a}", f"b={b}",
        "--api-keys-file", str(tmp_path / "keys.json"), "--usage-db", db,
        "--enable-runtime-lora", "--lora-root", os.path.dirname(b)])
    try:
        def client(key):
            return OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)

        def complete(key, model):
            return client(key).completions.create(model=model, prompt=PROMPT, max_tokens=3,
                                                  temperature=0)
        assert {m.id for m in client("sk-a").models.list().data} == {"tiny", "a"}
        assert {m.id for m in client("sk-none").models.list().data} == {"tiny"}
        assert {m.id for m in client("sk-ops").models.list().data} == {"tiny", "a", "b"}
        complete("sk-a", "a")
        complete("sk-a", "tiny")
        complete("sk-ops", "b")
        for key, model in (("sk-a", "b"), ("sk-none", "a")):
            with pytest.raises(NotFoundError, match=f"The model `{model}` does not exist"):
                complete(key, model)
        status, _, _ = http("POST", srv.url + "/tokenize", {"model": "b", "prompt": "x"},
                            headers={"Authorization": "Bearer sk-a"})
        assert status == 404
        status, _, got = http("POST", srv.url + "/v1/load_lora_adapter",
                              {"lora_name": "c", "lora_path": b},
                              headers={"Authorization": "Bearer sk-a"})
        assert status == 403 and "admin key" in got["error"]["message"]
        rows = sqlite3.connect(db).execute(
            "SELECT tenant, model, adapter FROM usage ORDER BY time").fetchall()
        assert rows == [("team-a", "tiny", "a"), ("team-a", "tiny", None), ("ops", "tiny", "b")]
        status, _, got = http("GET", srv.url + "/v1/usage?by=adapter",
                              headers={"Authorization": "Bearer sk-ops"})
        assert status == 200
        assert {r["adapter"]: r["requests"] for r in got["data"]} == {"": 1, "a": 1, "b": 1}
        _, _, text = http("GET", srv.url + "/metrics")
        assert 'folio:tenant_requests_total{adapter="a",finished_reason="length",' \
               'model_name="tiny",tenant="team-a"} 1.0' in text
        assert 'adapter="",finished_reason="length",model_name="tiny",tenant="team-a"} 1.0' \
            in text
    finally:
        srv.stop()


def test_unload_and_eviction_under_traffic_keep_each_request_s_adapter(setup):
    """One slot and one adapter kept in memory, requests of two adapters and
    the base streaming at once: the adapters take turns (reloaded after
    eviction), unloading one while its requests stream lets them finish with
    it; every text is the offline engine's, later requests for it are 404,
    and nothing is left running or holding blocks."""
    import threading

    from openai import NotFoundError, OpenAI
    base, a, b, _ = setup
    srv = ServerProcess(tiny_server_args(base) + [
        "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "1",
        "--lora-modules", f"a={a}", f"b={b}", "--enable-runtime-lora",
        "--lora-root", os.path.dirname(b)])
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        texts, errors = {}, []
        started = {"b0": threading.Event(), "b1": threading.Event()}

        def stream(key, model):
            try:
                parts = []
                for chunk in client.completions.create(
                        model=model, prompt=PROMPT, max_tokens=LONG if model == "b" else 24,
                        temperature=0, stream=True, extra_body={"ignore_eos": True}):
                    parts.append(chunk.choices[0].text)
                    if model == "b":
                        started[key].set()
                texts[key] = "".join(parts)
            except Exception as e:      # noqa: BLE001 - reported below
                errors.append((key, e))
        # b's long enough to be streaming still when it is unloaded: a stream's
        # first chunk may carry many tokens when the server is behind
        LONG = 200
        threads = [threading.Thread(target=stream, args=(f"{m}{i}", m))
                   for i in range(2) for m in ("a", "b", "tiny")]
        for t in threads:
            t.start()
        # both of b's requests in (streaming) before the unload: one that
        # arrives after it gets a 404, as later ones do (seen on a loaded machine)
        assert all(started[k].wait(60) for k in started)
        status, _, _ = http("POST", srv.url + "/v1/unload_lora_adapter", {"lora_name": "b"})
        assert status == 200
        assert "b0" not in texts or "b1" not in texts     # b's requests were streaming
        for t in threads:
            t.join(120)
        assert not errors, errors
        offline = {"a": _offline(base, LoRARequest("a", 1, a), 24),
                   "b": _offline(base, LoRARequest("b", 2, b), LONG),
                   "tiny": _offline(base, None, 24)}
        assert len(texts) == 6 and texts == {k: offline[k[:-1]] for k in texts}
        with pytest.raises(NotFoundError):
            client.completions.create(model="b", prompt=PROMPT, max_tokens=2)
        _, _, text = http("GET", srv.url + "/metrics")
        for name in ("folio:num_requests_running", "folio:kv_cache_usage_perc"):
            assert f'{name}{{model_name="tiny"}} 0.0' in text, name
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """A server that loads adapters while serving, from one root, two at most."""
    top = tmp_path_factory.mktemp("runtime_lora")
    base = make_tiny_model(top / "base", max_position_embeddings=256)
    root = top / "root"
    a, _ = make_lora_adapter(base, root / "a", seed=1, r=4, lora_alpha=8,
                             target_modules=["q_proj"])
    outside, _ = make_lora_adapter(base, top / "outside", seed=2, r=4, lora_alpha=8,
                                   target_modules=["q_proj"])
    os.symlink(outside, root / "link")            # inside the root, pointing out of it
    srv = ServerProcess(tiny_server_args(base) + [
        "--enable-lora", "--max-cpu-loras", "2", "--lora-modules", f"static={a}",
        "--enable-runtime-lora", "--lora-root", str(root)])
    yield srv, root, a, outside
    srv.stop()


def _load(srv, name, path):
    return http("POST", srv.url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


@pytest.mark.parametrize("path", ["../outside", "../../../../etc", "/etc", "/proc/self",
                                  "link", "{outside}", "{root}/../outside", "{root}/missing"])
def test_a_path_outside_the_roots_is_refused_without_repeating_it(runtime, path):
    srv, root, _, outside = runtime
    path = path.format(root=root, outside=outside)
    status, _, got = _load(srv, "x", path)
    assert status == 400 and got["error"]["param"] == "lora_path", got
    message = got["error"]["message"]
    assert "inside one of the server's --lora-root folders" in message
    assert path not in message and str(outside) not in message and "/etc" not in message


@pytest.mark.parametrize("name", ["x" * 129, "x" * 100_000, "has space", "ünïcode", "",
                                  "a\nb", "<script>"])
def test_an_unsafe_adapter_name_is_refused(runtime, name):
    srv, root, a, _ = runtime
    status, _, got = _load(srv, name, "a")
    assert status == 400 and got["error"]["param"] == "lora_name", got
    assert "1 to 128 characters" in got["error"]["message"]


def test_adapters_load_from_the_root_up_to_max_cpu_loras(runtime):
    """Relative to the root or absolute inside it; two loaded while serving
    (--max-cpu-loras 2) beside the one of --lora-modules, then a 400 until one
    is unloaded; /v1/models never lists more."""
    srv, root, a, _ = runtime
    assert _load(srv, "r1", "a")[0] == 200
    assert _load(srv, "org/r2", str(root / "a"))[0] == 200
    status, _, got = _load(srv, "r3", "a")
    assert status == 400 and "at most 2 adapters loaded while serving" in \
        got["error"]["message"]
    models = [m["id"] for m in http("GET", srv.url + "/v1/models")[2]["data"]]
    assert sorted(models) == ["org/r2", "r1", "static", "tiny"]
    assert http("POST", srv.url + "/v1/unload_lora_adapter", {"lora_name": "r1"})[0] == 200
    assert _load(srv, "r3", "a")[0] == 200
    status, _, out = http("POST", srv.url + "/v1/completions",
                          {"model": "r3", "prompt": "the cat", "max_tokens": 2})
    assert status == 200 and out["model"] == "r3"


def test_runtime_lora_needs_its_roots_when_the_command_line_is_read(tmp_path):
    import subprocess
    import sys
    for extra in (["--enable-runtime-lora"], ["--enable-runtime-lora", "--enable-lora"],
                  ["--enable-lora", "--lora-root", str(tmp_path / "nope")],
                  ["--enable-lora", "--lora-modules", "bad name=/x"]):
        done = subprocess.run([sys.executable, "-m", "folio.cli", "serve", *extra],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (extra, done.stderr)
        assert "--lora-root" in done.stderr or "lora" in done.stderr
