"""folio serve | generate | chat | bench throughput | serve | memory.

Engine options use vLLM's flag names so existing command lines carry over.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Iterator, Optional


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF folder, .gguf file or 'SmolLM2-135M-Instruct' (default)")
    g.add_argument("--dtype", default="auto",
                   help="auto | float32 | bfloat16 | float16 (CUDA) | float64")
    g.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory-bytes", default=None,
                   help="KV cache size, e.g. 4GiB (default: 2GiB on CPU, half the free memory on CUDA)")
    g.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", dest="num_kv_blocks",
                   type=int, default=None, help="exact number of KV blocks (overrides the size)")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse KV blocks of shared prompt prefixes (default on)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True, help="split long prompts across steps (default on)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="cap one request's prefill chunk per step (0: no cap)")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split every layer across N ranks (worker processes, gloo on CPU)")
    g.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                block_size=args.block_size, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
                enable_prefix_caching=args.enable_prefix_caching,
                enable_chunked_prefill=args.enable_chunked_prefill,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                scheduling_policy=args.scheduling_policy,
                tensor_parallel_size=args.tensor_parallel_size,
                distributed_executor_backend=args.distributed_executor_backend)


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: Optional[int]) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace):
    from folio import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                          ignore_eos=args.ignore_eos)


def stream_text(engine, request_id: str, prompt_ids: list[int], params) -> Iterator[str]:
    """Drive the engine for one request, yielding text deltas as they become final."""
    engine.add_tokenized_request(request_id, None, prompt_ids, params)
    sent = 0
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                text = out.outputs[0].text
                if len(text) > sent:
                    yield text[sent:]
                    sent = len(text)
    finally:
        if engine.has_unfinished_requests():
            engine.abort_request([request_id])


def cmd_generate(args: argparse.Namespace) -> int:
    from folio import LLM
    llm = LLM(args.model, **engine_kwargs(args))
    engine = llm.engine
    _, ids = engine.input_processor.tokenize(args.prompt)
    for delta in stream_text(engine, "generate-0", ids, sampling_params(args)):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from folio import LLM
    llm = LLM(args.model, **engine_kwargs(args))
    tok, params = llm.get_tokenizer(), sampling_params(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("Folio chat: type a message, /reset to start over, /exit or Ctrl-D to quit.",
          file=sys.stderr)
    for turn in range(10**9):
        try:
            line = input("> ")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        reply = []
        for delta in stream_text(llm.engine, f"chat-{turn}", tok.encode_chat(history), params):
            reply.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


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


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from folio.engine.llm_engine import LLMEngine
    from folio.server.app import ServerConfig, ServerState, build_app, served_name_for
    model = args.model_pos or args.model
    config = ServerConfig(
        served_model_name=args.served_model_name or served_name_for(model),
        api_key=args.api_key or os.environ.get("FOLIO_API_KEY") or None,
        allowed_origins=args.allowed_origins or [], drain_timeout=args.drain_timeout)
    kwargs = dict(engine_kwargs(args), max_logprobs=args.max_logprobs)

    def load():
        engine = LLMEngine.from_args(model, **kwargs)
        if args.chat_template:
            engine.tokenizer.chat_template = _read_template(args.chat_template)
        return engine

    app = build_app(ServerState(config, load))
    # uvicorn drains on SIGTERM, then re-raises the signal under the handler it
    # found installed: a no-op one makes the drained server exit with status 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_graceful_shutdown=int(args.drain_timeout))
    return 0


def _read_template(value: str) -> str:
    return open(value).read() if os.path.exists(value) else value


def cmd_bench_memory(args: argparse.Namespace) -> int:
    from folio.bench.memory import bench_memory, print_memory
    return _run_bench(args, bench_memory, print_memory)


def _bench_serve(args: argparse.Namespace) -> int:
    from folio.bench.serve_cli import cmd_bench_serve
    return cmd_bench_serve(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="folio", description="Folio LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    serve.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                       help="model to serve (same as --model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="also FOLIO_API_KEY; /health and "
                                                       "/metrics stay open")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--chat-template", default=None, help="a Jinja file or template text")
    serve.add_argument("--max-logprobs", type=int, default=20)
    serve.add_argument("--allowed-origins", nargs="*", default=None, help="CORS origins")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds SIGTERM waits for in-flight requests")
    serve.add_argument("--uvicorn-log-level", default="info")
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("--prompt", required=True)
    add_engine_args(gen)
    add_sampling_args(gen, max_tokens=64)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_args(chat)
    add_sampling_args(chat, max_tokens=None)
    chat.set_defaults(func=cmd_chat)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    tp = bench.add_parser("throughput", help="offline throughput against transformers and "
                                             "the machine's matmul ceiling")
    from folio.bench.throughput import add_throughput_args
    add_throughput_args(tp)
    add_engine_args(tp)
    tp.set_defaults(func=cmd_bench_throughput)
    from folio.bench.serve import add_serve_args
    sv = bench.add_parser("serve", help="latency and throughput of a running server")
    add_serve_args(sv)
    sv.set_defaults(func=_bench_serve)
    from folio.bench.memory import add_memory_args
    mem = bench.add_parser("memory", help="KV blocks saved by sharing (n > 1, shared prefixes)")
    add_memory_args(mem)
    add_engine_args(mem)
    mem.set_defaults(func=cmd_bench_memory)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    from folio.logger import configure_logging
    configure_logging()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"folio: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
