"""Decode steps from CUDA graphs: the buckets, the padding and the persistent
buffers are tested on the CPU, where an eager stand-in takes the capture's
place (it replays by calling the captured function again on the same
buffers, which is what a graph replays); the capture itself runs on a GPU."""

import random

import pytest
import torch

pytest.importorskip("triton", reason="graphs replay the TRITON backend (the dev extra pins it)")

from folio import LLM, SamplingParams
from folio.model.attention.triton_backend import TritonAttentionBackend
from folio.worker.cuda_graphs import DecodeGraphs, bucket_for, capture_sizes
from tests.utils import make_tiny_model


def test_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    sizes = capture_sizes(6)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 4, 5, 6, 7)] == [1, 2, 4, 4, 6, 6, None]


class EagerReplay:
    """A CPU stand-in for torch.cuda.graph: 'replay' runs the captured function
    again and writes into the output tensor the capture returned."""

    def __init__(self):
        self.captured = []

    def capture(self, fn):
        out = fn()
        self.captured.append(out.shape[0])
        return (lambda: out.copy_(fn())), out


def workload():
    rng = random.Random(3)
    return [{"prompt_token_ids": [rng.randrange(5, 384) for _ in range(n)]}
            for n in (5, 23, 2, 40, 11)]


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the CPU stand-in for graphs needs the TRITON kernels interpreted, "
                           "which a machine with CUDA does not set; the next test takes "
                           "real graphs there")
def test_padded_replays_give_the_eager_tokens(tmp_path, monkeypatch):
    # every decode split plan fixed for 128-token contexts: 4 splits of 32
    monkeypatch.setattr(TritonAttentionBackend, "target_programs", 1 << 20)
    monkeypatch.setattr(TritonAttentionBackend, "min_split_tokens", 32)
    folder = make_tiny_model(tmp_path)
    # lengths that end at different steps: batches of 3 pad to the bucket of 4
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (10, 7, 13, 4, 9)]
    kwargs = dict(dtype="float32", num_kv_blocks=64, block_size=8, max_model_len=128,
                  max_num_seqs=4, max_num_batched_tokens=48)
    eager = [o.outputs[0].token_ids for o in LLM(folder, attention_backend="TORCH_SDPA",
                                                 **kwargs).generate(workload(), params)]
    llm = LLM(folder, attention_backend="TRITON", **kwargs)
    runner = llm.engine.executor.runner
    assert runner.graphs is None                 # no CUDA: eager unless given graphs
    factory = EagerReplay()
    runner.graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.attn_backend,
                                 capture_sizes(4), 128 // 8, 128, runner.device, factory)
    runner.graphs.capture()
    assert factory.captured == [4, 2, 1]         # largest first
    got = [o.outputs[0].token_ids for o in llm.generate(workload(), params)]
    assert got == eager
    assert runner.graphs.replays > 0 and runner.graphs.padded_rows > 0
    assert llm.engine.scheduler.kv.num_free_blocks == 64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_graphs_on_a_gpu_give_the_eager_tokens(tmp_path):
    folder = make_tiny_model(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = []
    for eager in (True, False):
        # 0.3 each: the first LLM still holds its share while the second sizes its cache
        llm = LLM(folder, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
                  enforce_eager=eager, gpu_memory_utilization=0.3)
        runs.append([o.outputs[0].token_ids for o in llm.generate(workload(), params)])
        graphs = llm.engine.executor.runner.graphs
        assert (graphs is None) == eager and (eager or graphs.replays > 0)
        pieces = llm.engine.executor.runner.pieces       # the prompts' steps, piecewise
        assert (pieces is None) == eager and (eager or pieces.replays > 0)
    assert runs[0] == runs[1]


class EagerPieces(EagerReplay):
    """The stand-in for pieces, whose outputs are tuples (None where the
    fused rotary + cache write left no k and v)."""

    def capture(self, fn):
        outs = fn()
        self.captured.append(outs[0].shape[0])

        def replay():
            for mine, new in zip(outs, fn()):
                if mine is not None:
                    mine.copy_(new)
        return replay, outs


def test_piecewise_sizes():
    from folio.worker.cuda_graphs import piecewise_sizes
    assert piecewise_sizes(16) == [16]
    assert piecewise_sizes(48) == [16, 32, 48]
    assert piecewise_sizes(512) == [16, 32, 64, 128, 256, 512]


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the CPU stand-in needs the TRITON kernels interpreted; on a GPU "
                           "test_graphs_on_a_gpu_give_the_eager_tokens takes real pieces")
@pytest.mark.parametrize("fused", [False, True])
def test_piecewise_replays_of_prefill_and_mixed_steps_give_the_eager_tokens(tmp_path,
                                                                           monkeypatch, fused):
    """Steps with prompt tokens replayed piecewise (prefill, chunks beside
    decodes, padded to buckets of 16 and 32 tokens; decode-only steps eager
    here): the torch backend's tokens, with the rotary + cache write fused
    into the pieces (the fused kernels on, on the CPU a test switch) or left
    to the attention."""
    from folio.kernels import triton_elementwise
    from folio.worker.cuda_graphs import PiecewiseGraphs
    monkeypatch.setattr(triton_elementwise, "ON_CPU_FOR_TESTS", fused)
    folder = make_tiny_model(tmp_path)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (10, 7, 13, 4, 9)]
    kwargs = dict(dtype="float32", num_kv_blocks=64, block_size=8, max_model_len=128,
                  max_num_seqs=4, max_num_batched_tokens=32)
    with monkeypatch.context() as off:
        off.setattr(triton_elementwise, "ON_CPU_FOR_TESTS", False)
        eager = [o.outputs[0].token_ids for o in LLM(folder, attention_backend="TORCH_SDPA",
                                                     **kwargs).generate(workload(), params)]
    llm = LLM(folder, attention_backend="TRITON", **kwargs)
    runner = llm.engine.executor.runner
    assert runner.pieces is None                 # no CUDA: eager unless given pieces
    assert PiecewiseGraphs.serves(runner.model)
    factory = EagerPieces()
    runner.pieces = PiecewiseGraphs(runner.model, runner.kv_caches, runner.attn_backend,
                                    [16, 32], runner.device, factory)
    runner.pieces.capture()
    layers = len(runner.pieces.layers)
    assert factory.captured == [32] * (layers + 1) + [16] * (layers + 1)
    got = [o.outputs[0].token_ids for o in llm.generate(workload(), params)]
    assert got == eager
    assert runner.pieces.replays > 0 and runner.pieces.padded_rows > 0
    assert llm.engine.scheduler.kv.num_free_blocks == 64
