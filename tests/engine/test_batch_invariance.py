"""Greedy output that does not depend on the batch (issue 53): a request's
tokens are the same alone, in a batch, with its prompt chunked otherwise,
with n-gram proposals and with a draft model's, on the default configuration
(the default model's 4-bit codes, int8 activations) and with
--activation-quantization none, on a tiny random model, and on tiny K-quant
GGUFs (their int8 path rounds x per super-block).

What made them differ: a decode step with few (sequence, KV head) tasks for
the threads split each context into shares summed in another order, so a
request alone (split) and in a batch (not) differed in the last bits, which
int8 activations then rounded apart. Splits are off unless
FOLIO_ATTENTION_SPLITS=1 (kernels/native/paged_attention.c); the kernel's
own test holds a decode's row bit for bit to the one it has in a bigger
batch (tests/model/test_native_attention.py)."""

import random

import pytest

from folio import LLM, SamplingParams
from folio.bench.texts import ALICE
from folio.model.loader import resolve_model_path
from tests.utils import make_tiny_model

pytestmark = pytest.mark.threads(2)     # the kernels' threaded paths (tests/conftest.py)

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
# prompts of random tokens (no proposals) and chats that copy (n-gram proposals)
_rng = random.Random(0)
RANDOM = [{"prompt_token_ids": [_rng.randrange(100, 49000) for _ in range(112)]}
          for _ in range(5)]
COPIES = [[{"role": "user", "content": "Repeat this passage exactly:\n\n"
            + ALICE[200 * i:200 * i + 400]}] for i in range(3)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _every_way(make, prompts, chats):
    """The same greedy requests: batched (the reference), alone, chunked by
    48 tokens with n-gram proposals, and with the model's own int4 codes as a
    draft; each way's tokens, and the runs of proposals that stood."""
    base = make()
    want = _ids(base.generate(prompts, GREEDY, use_tqdm=False))
    want_chats = _ids(base.chat(chats, GREEDY, use_tqdm=False)) if chats else []
    alone = [_ids(base.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    assert alone == want
    spec = make(max_num_batched_tokens=48, speculative_config=NGRAM)
    assert _ids(spec.generate(prompts, GREEDY, use_tqdm=False)) == want
    if chats:
        assert _ids(spec.chat(chats, GREEDY, use_tqdm=False)) == want_chats
        assert spec.engine.scheduler.spec_counts.accepted_tokens > 0
    return base, want, want_chats


@pytest.mark.parametrize("activations", ["auto", "none"])
def test_the_default_model_alone_batched_chunked_and_speculating(activations):
    path, _ = resolve_model_path(None)

    def make(**kw):
        return LLM(dtype="float32", num_kv_blocks=256, max_model_len=2048,
                   activation_quantization=activations, **kw)
    base, want, want_chats = _every_way(make, RANDOM, COPIES)
    draft = make(speculative_config={"method": "draft_model", "model": path,
                                     "num_speculative_tokens": 3, "quantization": "int4"})
    assert _ids(draft.chat(COPIES, GREEDY, use_tqdm=False)) == want_chats
    assert _ids(draft.generate(RANDOM[:2], GREEDY, use_tqdm=False)) == want[:2]
    assert draft.engine.scheduler.spec_counts.accepted_tokens > 0
    if activations == "auto":       # the default: int8 activations for GGUF codes
        assert base.engine.config.activation_quantization == "int8"


def _tiny_every_way(path, seed):
    """_every_way on a tiny model at path (ids under 380): random prompts of
    20-90 tokens and one that repeats itself (the n-gram proposer finds runs
    in it)."""
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(5, 380) for _ in range(rng.randint(20, 90))]}
               for _ in range(6)]
    prompts.append({"prompt_token_ids": [7, 8, 9, 10, 11] * 12})

    def make(**kw):
        return LLM(path, dtype="float32", num_kv_blocks=256, block_size=8, **kw)
    return _every_way(make, prompts, [])


def test_a_tiny_random_model_alone_batched_chunked_and_speculating(tmp_path):
    _tiny_every_way(make_tiny_model(tmp_path / "m", max_position_embeddings=512), 1)


@pytest.mark.parametrize("name", ["tiny-llama-Q4_K_M.gguf", "tiny-llama-Q5_K_M.gguf"])
def test_a_k_quant_gguf_alone_batched_chunked_and_speculating(name):
    """A K-quant file (made by llama-quantize) on its default configuration:
    its layers take the int8 path with x per super-block (qlinear.c's sblock,
    and rows4 / rows4_q4_all with sup on AVX2 without VNNI), whose rows must
    come out the same bits in any step."""
    from pathlib import Path
    base, _, _ = _tiny_every_way(str(Path(__file__).parents[1] / "fixtures" / "gguf" / name), 2)
    assert base.engine.config.activation_quantization == "int8"
