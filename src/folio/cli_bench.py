"""`folio bench throughput | serve | memory | weights | embeddings | gpu | host | autoscale`: each benchmark's
flags are defined when its command is used, so no other command waits for
the benchmarks' imports."""

from __future__ import annotations

import argparse
import importlib

from folio.cli_engine import add_engine_args, engine_kwargs
from folio.cli_types import add_command


def _lazy(module: str, name: str, *then):
    """`module.name(arg)`, imported only when called, then each of `then(arg)`
    (the engine flags after a benchmark's own)."""
    def call(arg):
        result = getattr(importlib.import_module(f"folio.bench.{module}"), name)(arg)
        for more in then:
            more(arg)
        return result
    return call


def _in_process(module: str, bench: str, report: str):
    """An in-process benchmark on a fresh engine: one JSON object, or the report."""
    def run(args: argparse.Namespace) -> int:
        import json

        from folio.engine.llm_engine import LLMEngine
        m = importlib.import_module(f"folio.bench.{module}")
        result = getattr(m, bench)(args, LLMEngine.from_args(args.model, **engine_kwargs(args)))
        if args.json:
            print(json.dumps(result))
        else:
            getattr(m, report)(result)
        return 0
    return run


def _bench_host(args: argparse.Namespace) -> int:
    import json

    from folio.bench.host import print_host, run
    result = run(args)
    print(json.dumps(result)) if args.json else print_host(result)
    return 0


def _bench_gpu(args: argparse.Namespace) -> int:
    from folio.bench.gpu import bench_gpu, markdown
    print(markdown(bench_gpu(args)), end="")
    return 0


def add_bench(sub) -> None:
    bench = add_command(sub, "bench", "benchmarks", None)
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    # Defined when used: no command waits for the benchmarks' imports.
    add_command(kinds, "throughput", "offline throughput against transformers and the "
                 "machine's matmul ceiling",
                 _in_process("throughput", "bench_throughput", "print_report")).defer(
        _lazy("throughput", "add_throughput_args", add_engine_args))
    add_command(kinds, "serve", "latency and throughput of a running server",
                 _lazy("serve_cli", "cmd_bench_serve")).defer(_lazy("serve", "add_serve_args"))
    add_command(kinds, "memory", "KV blocks saved by sharing (n > 1, shared prefixes)",
                 _in_process("memory", "bench_memory", "print_memory")).defer(
        _lazy("memory", "add_memory_args", add_engine_args))
    add_command(kinds, "weights", "bytes of weights as loaded, and the same formats' "
                 "bytes for Llama-3-8B and -70B shapes",
                 _in_process("weights", "bench_weights", "print_weights")).defer(
        _lazy("weights", "add_weights_args", add_engine_args))
    add_command(kinds, "embeddings", "sentences a second embedded, beside "
                 "sentence-transformers on the same folder and sentences",
                 _in_process("embeddings", "bench_embeddings", "print_embeddings")).defer(
        _lazy("embeddings", "add_embeddings_args", add_engine_args))
    add_command(kinds, "gpu", "the GPU path on a random Llama-3-8B: correctness, batch-1 "
                 "decode, throughput against transformers, memory",
                 _bench_gpu).defer(_lazy("gpu", "add_gpu_args"))
    add_command(kinds, "host", "the engine's host cost per decode step on a negligible "
                 "model, and the step period beside a stand-in device",
                 _bench_host).defer(_lazy("host", "add_host_args"))
    add_command(kinds, "autoscale", "a replica pool on the measured service curve: fixed, "
                 "queue-keyed and utilization-keyed scaling side by side",
                 _lazy("autoscale_cli", "cmd_bench_autoscale")).defer(
        _lazy("autoscale_cli", "add_autoscale_args"))
