"""`folio bench throughput | serve | memory | weights | gpu | autoscale`: each benchmark's
flags are defined when its command is used, so no other command waits for
the benchmarks' imports."""

from __future__ import annotations

import argparse

from folio.cli_engine import add_engine_args, engine_kwargs
from folio.cli_types import add_command


def _run_bench(args: argparse.Namespace, bench, report) -> int:
    """An in-process benchmark on a fresh engine: one JSON object, or the report."""
    import json

    from folio.engine.llm_engine import LLMEngine
    result = bench(args, LLMEngine.from_args(args.model, **engine_kwargs(args)))
    if args.json:
        print(json.dumps(result))
    else:
        report(result)
    return 0


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from folio.bench.throughput import bench_throughput, print_report
    return _run_bench(args, bench_throughput, print_report)


def cmd_bench_memory(args: argparse.Namespace) -> int:
    from folio.bench.memory import bench_memory, print_memory
    return _run_bench(args, bench_memory, print_memory)


def cmd_bench_weights(args: argparse.Namespace) -> int:
    from folio.bench.weights import bench_weights, print_weights
    return _run_bench(args, bench_weights, print_weights)


def _bench_gpu(args: argparse.Namespace) -> int:
    from folio.bench.gpu import bench_gpu, markdown
    print(markdown(bench_gpu(args)), end="")
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from folio.bench.serve_cli import cmd_bench_serve
    return cmd_bench_serve(args)


def _bench_autoscale(args: argparse.Namespace) -> int:
    from folio.bench.autoscale_cli import cmd_bench_autoscale
    return cmd_bench_autoscale(args)


def add_bench(sub) -> None:
    bench = add_command(sub, "bench", "benchmarks", None)
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    # Defined when used: no command waits for the benchmarks' imports.
    add_command(kinds, "throughput", "offline throughput against transformers and the "
                 "machine's matmul ceiling", cmd_bench_throughput).defer(_throughput_flags)
    add_command(kinds, "serve", "latency and throughput of a running server",
                 _bench_serve).defer(_bench_serve_flags)
    add_command(kinds, "memory", "KV blocks saved by sharing (n > 1, shared prefixes)",
                 cmd_bench_memory).defer(_memory_flags)
    add_command(kinds, "weights", "bytes of weights as loaded, and the same formats' "
                 "bytes for Llama-3-8B and -70B shapes", cmd_bench_weights).defer(_weights_flags)
    add_command(kinds, "gpu", "the GPU path on a random Llama-3-8B: correctness, batch-1 "
                 "decode, throughput against transformers, memory", _bench_gpu).defer(_gpu_flags)
    add_command(kinds, "autoscale", "a replica pool on the measured service curve: fixed, "
                 "queue-keyed and utilization-keyed scaling side by side",
                 _bench_autoscale).defer(_autoscale_flags)


def _throughput_flags(p: argparse.ArgumentParser) -> None:
    from folio.bench.throughput import add_throughput_args
    add_throughput_args(p)
    add_engine_args(p)


def _bench_serve_flags(p: argparse.ArgumentParser) -> None:
    from folio.bench.serve import add_serve_args
    add_serve_args(p)


def _memory_flags(p: argparse.ArgumentParser) -> None:
    from folio.bench.memory import add_memory_args
    add_memory_args(p)
    add_engine_args(p)


def _weights_flags(p: argparse.ArgumentParser) -> None:
    from folio.bench.weights import add_weights_args
    add_weights_args(p)
    add_engine_args(p)


def _gpu_flags(p: argparse.ArgumentParser) -> None:
    from folio.bench.gpu import add_gpu_args
    add_gpu_args(p)


def _autoscale_flags(p: argparse.ArgumentParser) -> None:
    from folio.bench.autoscale_cli import add_autoscale_args
    add_autoscale_args(p)
