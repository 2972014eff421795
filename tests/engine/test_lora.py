"""LoRA adapters in the engine (issue 31), offline: adapters made by the real
`peft` package on a tiny random model; Folio's greedy tokens and prompt
logprobs with each adapter are transformers' on peft's merged weights,
alone and in a batch that mixes three adapters and the base; the grouped
LoRA product against its per-token reference; the prefix cache keyed by
adapter; max_loras and max_cpu_loras; what is refused."""

import pytest
import torch

from folio import LLM, SamplingParams
from folio.lora_request import LoRARequest
from folio.model.lora.layers import add_lora, batch_runs, reference_lora
from tests.parity import assert_greedy_parity, reference_greedy, reference_prompt_logprobs
from tests.utils import load_reference_model, make_lora_adapter, make_tiny_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
NEW = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(base folder, {name: (LoRARequest, peft's merged model)}): three adapters
    saved by peft (tests/utils.make_lora_adapter): every projection at rank
    8, q/v only at rank 4, and the MLP at rank 16 with rsLoRA."""
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model(root / "base")
    adapters = {}
    specs = {"all": dict(r=8, lora_alpha=16, target_modules=ATTENTION + MLP),
             "qv": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
             "mlp": dict(r=16, lora_alpha=8, target_modules=MLP, use_rslora=True)}
    for i, (name, spec) in enumerate(specs.items()):
        path, merged = make_lora_adapter(base, root / name, seed=i, **spec)
        adapters[name] = (LoRARequest(name, i + 1, path), merged)
    return base, adapters


PROMPTS = [list(range(5, 40)), list(range(300, 250, -2))]


def _greedy(llm, prompts, loras):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True),
                        lora_request=loras, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_tokens_and_prompt_logprobs_are_peft_s_alone_and_mixed(tiny):
    base, adapters = tiny
    llm = LLM(base, dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=3)
    cases = [(None, load_reference_model(base))] + list(adapters.values())
    # a batch of every adapter and the base, each on both prompts
    batch = [(lora, ref, p) for lora, ref in cases for p in PROMPTS]
    mixed = _greedy(llm, [p for _, _, p in batch], [lora for lora, _, _ in batch])
    refs = []
    for (lora, ref, p), got in zip(batch, mixed):
        want, gaps = reference_greedy(ref, p, NEW, ())
        assert_greedy_parity(got, want, gaps, label=f"{lora and lora.lora_name} {len(p)}")
        refs.append(want)
    # the adapters do change the tokens, and each alone gives what it gave mixed
    assert len({tuple(t) for t in refs[::2]}) == len(cases)
    for lora, ref in cases:
        assert _greedy(llm, PROMPTS[:1], [lora]) == [refs[cases.index((lora, ref)) * 2]]
        out = llm.generate({"prompt_token_ids": PROMPTS[1]},
                           SamplingParams(max_tokens=1, prompt_logprobs=0),
                           lora_request=lora, use_tqdm=False)[0]
        got = torch.tensor([e[t] for e, t in zip(out.prompt_logprobs[1:], PROMPTS[1][1:])])
        assert torch.allclose(got, reference_prompt_logprobs(ref, PROMPTS[1]), atol=1e-4)
    assert llm.engine.scheduler.kv.num_free_blocks == 64


def test_the_grouped_product_is_the_per_token_one():
    """Random slots of different ranks (zero-padded), rows of each adapter and
    of none interleaved in any order: runs of one adapter's consecutive rows,
    several runs of the same adapter among them."""
    g = torch.Generator().manual_seed(0)
    for trial in range(5):
        slots, width, inp, out, rows = 4, 24, 40, 56, 37
        a = torch.randn(slots, width, inp, generator=g)
        b = torch.randn(slots, out, width, generator=g)
        b[1, :, 8:] = 0                       # a lower rank in slot 1
        which = [None if v == slots else v
                 for v in torch.randint(0, slots + 1, (rows,), generator=g).tolist()]
        runs, start = [], 0
        for i in range(1, rows + 1):
            if i == rows or which[i] != which[start]:
                if which[start] is not None:
                    runs.append((which[start], start, i))
                start = i
        assert len(runs) > slots            # some adapter has several runs
        x = torch.randn(rows, inp, generator=g)
        y = torch.randn(rows, out, generator=g)
        got = add_lora(x, y.clone(), a, b, runs)
        assert torch.allclose(got, y + reference_lora(x, a, b, which), atol=1e-4), trial
        # one run per slot (a step of decodes): the batched product over all slots
        firsts = {}
        for slot, start, end in runs:
            firsts.setdefault(slot, (slot, start, end))
        one_each = sorted(firsts.values(), key=lambda r: r[1])
        only = [w if any(s <= i < e for _, s, e in one_each) else None
                for i, w in enumerate(which)]
        batched = batch_runs(one_each, slots, "cpu")
        assert batched is not None and batch_runs(runs, slots, "cpu") is None
        got = add_lora(x, y.clone(), a, b, one_each, batched=batched)
        assert torch.allclose(got, y + reference_lora(x, a, b, only), atol=1e-4), trial
        # bf16 rows and outputs, fp32 slots: the delta in fp32, then rounded once
        yb = y.bfloat16()
        got = add_lora(x.bfloat16(), yb.clone(), a, b, runs)
        want = yb + reference_lora(x.bfloat16(), a, b, which).bfloat16()
        assert torch.allclose(got.float(), want.float(), atol=0.1, rtol=0.02), trial


def test_torch_s_products_where_no_kernel_serves_give_the_kernel_s_tokens(tiny, monkeypatch):
    """Without a C compiler (or Triton on CUDA) the layers multiply each run
    in torch (`add_lora`): a batch mixing every adapter and the base gives
    the grouped kernel's greedy tokens."""
    from folio.model.lora import layers
    base, adapters = tiny
    loras = [None] + [adapters[n][0] for n in ("all", "qv", "mlp")]
    prompts = [PROMPTS[i % 2][:12 + 5 * i] for i in range(4)] * 2
    want = _greedy(LLM(base, dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=3),
                   prompts, loras * 2)
    monkeypatch.setattr(layers, "_kernel", lambda device, dtype: None)
    llm = LLM(base, dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=3)
    assert all(layer.kernel is None for layer in llm.engine.executor.runner.loras.layers)
    assert _greedy(llm, prompts, loras * 2) == want


def test_the_prefix_cache_is_keyed_by_adapter(tiny):
    """The same prompt under another adapter (or none) never takes the blocks
    computed under the first; under the same adapter it does."""
    base, adapters = tiny
    a, b = adapters["all"][0], adapters["qv"][0]
    llm = LLM(base, dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    params = SamplingParams(temperature=0, max_tokens=2)
    prompt = {"prompt_token_ids": list(range(10, 60))}

    def cached(lora):
        return llm.generate(prompt, params, lora_request=lora,
                            use_tqdm=False)[0].num_cached_tokens
    assert cached(a) == 0
    assert cached(b) == 0 and cached(None) == 0
    assert cached(a) == 48 and cached(b) == 48 and cached(None) == 48


def test_max_loras_and_eviction_keep_every_request_s_adapter(tiny):
    """One slot and one adapter kept in memory, three adapters in one call:
    requests of a second adapter wait until the first's are done, adapters
    are reloaded after eviction, and every request gets its own adapter's
    tokens; nothing leaks."""
    base, adapters = tiny
    loras = [adapters[n][0] for n in ("all", "qv", "mlp", "all")]
    want = [_greedy(LLM(base, dtype="float32", num_kv_blocks=64, enable_lora=True,
                        max_loras=3), PROMPTS[:1], [lora])[0] for lora in loras]
    llm = LLM(base, dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=1,
              max_cpu_loras=1)
    got = _greedy(llm, PROMPTS[:1] * 4, loras)
    assert got == want
    assert len(llm.engine.executor.runner.loras.adapters) == 1
    assert llm.engine.scheduler.kv.num_free_blocks == 64


def test_samples_beams_constraints_and_preemption_run_as_on_the_merged_weights(
        tiny, tmp_path):
    """Under an adapter, `n > 1` seeded samples, a beam search, a regex
    constraint, and greedy requests of two adapters and the base preempted
    for want of blocks give what Folio gives on peft's merged weights saved
    as a plain model (the merged model's own runs are held to transformers
    elsewhere); every block comes back."""
    import shutil

    from folio import BeamSearchParams
    base, adapters = tiny
    merged = {}
    for name in ("all", "mlp"):
        shutil.copytree(base, tmp_path / name)
        adapters[name][1].save_pretrained(tmp_path / name)
        merged[name] = LLM(str(tmp_path / name), dtype="float32", num_kv_blocks=64)
    llm = LLM(base, dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    lora, ref = adapters["all"][0], merged["all"]
    prompt = {"prompt_token_ids": PROMPTS[0]}
    sampled = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=12,
                                 structured_outputs={"regex": "[a-e]{3}-[0-9]{2}"})
    for params in (sampled, constrained):
        got = llm.generate(prompt, params, lora_request=lora, use_tqdm=False)[0]
        want = ref.generate(prompt, params, use_tqdm=False)[0]
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
        plain = llm.generate(prompt, params, use_tqdm=False)[0]      # the adapter matters
        assert [o.token_ids for o in plain.outputs] != [o.token_ids for o in want.outputs]
    beams = BeamSearchParams(beam_width=3, max_tokens=10)
    got = llm.beam_search(prompt, beams, lora_request=lora)[0]
    want = ref.beam_search(prompt, beams)[0]
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    assert got.outputs[0].token_ids != llm.beam_search(prompt, beams)[0].outputs[0].token_ids
    assert [o.score for o in got.outputs] == pytest.approx([o.score for o in want.outputs],
                                                           abs=1e-4)
    # preempted: block size 4, too few blocks for all six at once
    small = LLM(base, dtype="float32", num_kv_blocks=40, block_size=4, enable_lora=True,
                max_loras=2, max_num_batched_tokens=32, max_num_seqs=6)
    loras = [lora, adapters["mlp"][0], None] * 2
    prompts = [PROMPTS[i % 2][:20 + i] for i in range(6)]
    got = _greedy(small, prompts, loras)
    want = [_greedy(merged[x.lora_name] if x else llm, [p], [None])[0]
            for p, x in zip(prompts, loras)]
    assert got == want
    plain = _greedy(llm, prompts[:2], [None, None])     # both adapters change the tokens
    assert plain[0] != got[0] and plain[1] != got[1]
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.scheduler.kv.num_free_blocks == 40
    assert llm.engine.scheduler.kv.num_free_blocks == 64


def test_tensor_parallel_ranks_hold_their_slices_of_each_adapter(tiny):
    """TP 2 (one KV head per rank) and 4 (KV heads replicated): a batch that
    mixes three adapters and the base gives the single rank's greedy tokens
    (themselves peft's, above); A whole and B split on column-parallel
    layers, A split and B whole on row-parallel ones."""
    base, adapters = tiny
    loras = [None] + [adapters[n][0] for n in ("all", "qv", "mlp")]
    prompts = [PROMPTS[i % 2][:15 + 3 * i] for i in range(4)]
    want = _greedy(LLM(base, dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=3),
                   prompts, loras)
    for tp in (2, 4):
        llm = LLM(base, dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=3,
                  tensor_parallel_size=tp)
        try:
            assert _greedy(llm, prompts, loras) == want, tp
        finally:
            llm.shutdown()


def test_what_is_refused(tiny, tmp_path):
    base, adapters = tiny
    lora = adapters["all"][0]
    plain = LLM(base, dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate({"prompt_token_ids": [1, 2]}, lora_request=lora, use_tqdm=False)
    llm = LLM(base, dtype="float32", num_kv_blocks=16, enable_lora=True)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate({"prompt_token_ids": [1, 2]}, use_tqdm=False,
                     lora_request=LoRARequest("x", 9, str(tmp_path)))
    llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=1),
                 lora_request=lora, use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'all'"):
        llm.generate({"prompt_token_ids": [1, 2]}, use_tqdm=False,
                     lora_request=LoRARequest("other", 1, adapters["qv"][0].lora_path))
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, "p")
    assert llm.engine.scheduler.kv.num_free_blocks == 16
    for kw, message in [({"speculative_config": {"method": "ngram"}},
                         "speculative decoding are not supported"),
                        ({"max_loras": 0}, "max_loras must be a positive integer"),
                        ({"max_loras": 2, "max_cpu_loras": 1}, "max_cpu_loras .1. must be at "
                                                               "least max_loras")]:
        with pytest.raises(ValueError, match=message):
            LLM(base, dtype="float32", num_kv_blocks=16, enable_lora=True, **kw)
