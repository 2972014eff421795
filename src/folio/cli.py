"""folio serve | generate | chat | bench | env | usage | plan (cli_bench.py: the
benchmarks; cli_admin.py: env, usage and plan; cli_engine.py: the engine flags).

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

from folio.cli_admin import add_env, add_plan, add_usage
from folio.cli_bench import add_bench
from folio.cli_chat import CHAT_USAGE, Chat, print_stream, read_message, stream_outputs
from folio.cli_engine import add_engine_args, add_lora_flags, engine_kwargs
from folio.cli_types import (AppendCommaSeparated, FolioArgumentParser, add_command, fraction,
                             existing_dir, non_negative_float, non_negative_int, port,
                             positive_float, positive_int, probability, seed, top_k)
from folio.errors import is_expected_error
from folio.generation_config import CHAT_DEFAULTS, chat_defaults


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


def _tool_parser(args: argparse.Namespace) -> Optional[str]:
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together")
    return args.tool_call_parser


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM (0, after draining) or a fatal error: a model that fails to
    load or an engine that dies prints one line and ends the process with 1."""
    core = None
    if args.engine_process:
        # started first: it imports torch and the model code while this
        # process does the same for the config (engine/core_process.py)
        from folio.engine.core_process import CoreProcess
        core = CoreProcess()
    import uvicorn

    from folio.engine.llm_engine import LLMEngine
    from folio.model.loader import own_names
    from folio.server.app import (ServerConfig, ServerState, build_app, request_bytes_for,
                                  served_name_for)
    model = args.model_pos or args.model
    config = ServerConfig(
        served_model_name=(args.served_model_name or [served_name_for(model)])[0],
        served_model_aliases=(args.served_model_name[1:] if args.served_model_name
                              else own_names(model)),
        api_key=args.api_key or os.environ.get("FOLIO_API_KEY") or None,
        allowed_origins=args.allowed_origins or [], drain_timeout=args.drain_timeout,
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=_tool_parser(args), reasoning_parser=args.reasoning_parser,
        api_keys_file=args.api_keys_file,
        usage_db=args.usage_db, cost_per_hour=args.cost_per_hour,
        prompt_token_weight=args.prompt_token_weight,
        max_tokens_default=args.max_tokens_default, max_tokens_limit=args.max_tokens_limit,
        request_timeout=args.request_timeout, lora_modules=args.lora_modules,
        runtime_lora=args.enable_runtime_lora, lora_roots=args.lora_root or [],
        max_runtime_loras=args.max_cpu_loras or args.max_loras)
    from folio.engine.config_builder import build_config
    # checked before the server starts: a bad value is one line, and no port is bound
    engine_config = build_config(model, **engine_kwargs(args), max_logprobs=args.max_logprobs)
    config.max_request_bytes = args.max_request_bytes or request_bytes_for(
        engine_config.scheduler.max_model_len)
    _apply_generation_config(config, args, model)
    if args.trust_remote_code:
        logging.getLogger("folio").info("--trust-remote-code: accepted and unused (Folio runs "
                                        "no code from a checkpoint)")
    template = _read_template(args.chat_template) if args.chat_template else None
    sock = _listen(args.host, args.port)        # before the model loads: a port in use fails now

    def load():
        if args.engine_process:
            from folio.engine.mp_client import MPEngineClient
            engine = MPEngineClient(engine_config, chat_template=template, start=False,
                                    core=core)
        else:
            engine = LLMEngine(engine_config)
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
    # uvicorn says this itself only for the sockets it binds
    logging.getLogger("uvicorn.error").info(
        "Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
        f"[{args.host}]" if ":" in args.host else args.host, sock.getsockname()[1])
    # uvicorn drains on SIGTERM, then re-raises the signal under the handler it
    # found installed: a no-op one makes the drained server exit with status 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run(sockets=[sock])
    if state.fatal:         # said last, after uvicorn's shutdown lines
        print(f"folio: error: {state.fatal}", file=sys.stderr)
        return 1
    return 0


def _listen(host: str, port: int):
    """The server's socket, bound as uvicorn binds one: a port in use is one
    `folio: error:` line and status 1, before anything loads."""
    import errno
    import socket
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)       # listening now: a second server's bind fails here too
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is in use ({e.strerror}): stop what "
                             f"listens there or pass another --port") from None
        raise ValueError(f"cannot listen on {host} port {port}: {e.strerror or e}") from None
    return sock


def _apply_generation_config(config, args: argparse.Namespace, model: Optional[str]) -> None:
    """--generation-config: the sampling defaults of the model folder's
    generation_config.json (auto), of another folder's (PATH), or none (vllm:
    OpenAI's defaults); its max_new_tokens is the default max_tokens unless
    --max-tokens-default gives one."""
    from folio.generation_config import read_generation_config
    source = args.generation_config
    if source == "vllm":
        return
    folder = model if source == "auto" else source
    defaults = read_generation_config(folder if folder and os.path.isdir(folder) else None)
    max_tokens = defaults.pop("max_tokens", None)
    if max_tokens is not None and config.max_tokens_default is None and (
            config.max_tokens_limit is None or max_tokens <= config.max_tokens_limit):
        config.max_tokens_default = max_tokens
    config.sampling_defaults = defaults
    if defaults or max_tokens is not None:
        logging.getLogger("folio").info(
            "sampling defaults from %s/generation_config.json: %s%s (--generation-config vllm: "
            "none)", folder, defaults, f", max_tokens {max_tokens}" if max_tokens else "")


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


def build_parser() -> argparse.ArgumentParser:
    from folio import __version__
    parser = FolioArgumentParser(prog="folio", description="Folio LLM inference engine")
    parser.add_argument("--version", action="version", version=f"folio {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_generate(sub)
    _add_chat(sub)
    add_bench(sub)
    add_env(sub)
    add_usage(sub)
    add_plan(sub)
    return parser


def _add_serve(sub) -> None:
    serve = add_command(sub, "serve", "the OpenAI-compatible HTTP server", cmd_serve)
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
    serve.add_argument("--api-keys-file", default=None, metavar="FILE",
                       help="tenants: a JSON or YAML file of keys (or their SHA-256), each "
                            "naming a tenant, with optional requests_per_minute, "
                            "tokens_per_minute, tokens_per_day and admin (default: none)")
    serve.add_argument("--usage-db", default=None, metavar="PATH",
                       help="the SQLite usage ledger: a row per finished request, committed "
                            "before its response ends (default: none, no ledger)")
    serve.add_argument("--cost-per-hour", type=positive_float, default=None, metavar="DOLLARS",
                       help="what the machine costs an hour: /metrics reports "
                            "folio:cost_per_1k_tokens and the ledger each request's share "
                            "(default: none)")
    serve.add_argument("--prompt-token-weight", type=non_negative_float, default=0.25,
                       metavar="W", help="a prompt token's cost as a share of an output "
                                         "token's, for --cost-per-hour")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model names that clients send and /v1/models lists, the "
                            "first the one responses and metrics give (default: the model "
                            "id, or the file or folder name; a .gguf file also answers to "
                            "its name without .gguf, the default model's file to "
                            "SmolLM2-135M-Instruct)")
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
    serve.add_argument("--reasoning-parser", choices=["qwen3"], default=None,
                       help="split a chat answer's thinking into the message's "
                            "reasoning_content: qwen3 (<think>...</think>, as Qwen3 and "
                            "QwQ write it)")
    serve.add_argument("--max-logprobs", type=non_negative_int, metavar="N", default=20,
                       help="the most top logprobs a request may ask for")
    serve.add_argument("--allowed-origins", action=AppendCommaSeparated, default=None,
                       metavar="ORIGIN",
                       help="a web origin that browsers may call the API from (CORS); repeat "
                            "the flag or separate origins with commas; '*' allows any "
                            "(default: none, CORS off)")
    serve.add_argument("--max-tokens-default", type=positive_int, metavar="N", default=None,
                       help="the max_tokens of a request that gives none (default: what the "
                            "context has left, as OpenAI's chat does)")
    serve.add_argument("--max-tokens-limit", type=positive_int, metavar="N", default=None,
                       help="the most tokens one request may generate (per choice): a request "
                            "that asks for more is a 400, one that asks for none gets at most "
                            "this (default: no limit but the context)")
    add_lora_flags(serve)
    serve.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       type=_lora_module,
                       help="LoRA adapters served under their own names (needs --enable-lora): "
                            "name=path, or JSON {\"name\": ..., \"path\": ...}; a request "
                            "names one in its model field")
    serve.add_argument("--max-request-bytes", type=positive_int, metavar="N", default=None,
                       help="the largest request body taken: a larger one is a 413, before "
                            "it is parsed (default: 1 MiB + 64 bytes a token of "
                            "--max-model-len)")
    serve.add_argument("--generation-config", default="auto", type=_generation_config,
                       metavar="auto|vllm|PATH",
                       help="sampling defaults for the fields a request leaves unset: auto, "
                            "the model folder's generation_config.json (temperature, top_p, "
                            "top_k, min_p, repetition_penalty; max_new_tokens as the default "
                            "max_tokens); PATH, another folder's; vllm, none (OpenAI's "
                            "defaults)")
    serve.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for vLLM's command lines and unused: Folio runs no code "
                            "from a checkpoint")
    serve.add_argument("--enable-runtime-lora", action="store_true",
                       help="let POST /v1/load_lora_adapter and /v1/unload_lora_adapter change "
                            "the adapters while serving (needs --enable-lora and --lora-root; "
                            "an admin key with --api-keys-file; default: off)")
    serve.add_argument("--lora-root", action="append", type=existing_dir, default=None,
                       metavar="DIR",
                       help="a folder whose adapters may be loaded while serving (repeat for "
                            "several): a lora_path must resolve inside one, symlinks followed")
    serve.add_argument("--request-timeout", type=positive_float, metavar="SECONDS", default=None,
                       help="seconds a request may generate for, from its start: past them it "
                            "is aborted and its client gets a 504 (default: no limit)")
    serve.add_argument("--drain-timeout", type=non_negative_float, metavar="SECONDS", default=30.0,
                       help="seconds that SIGTERM waits for in-flight requests before exiting")
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                       help="run the engine core (scheduler, model) in a process of its own, "
                            "the HTTP server, the text and the streams in this one (default); "
                            "--no-engine-process: the engine in a thread of this process")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's log level (info logs each request)")
    add_engine_args(serve)


def _add_generate(sub) -> None:
    gen = add_command(sub, "generate", "complete one prompt and print the text", cmd_generate)
    gen.add_argument("--prompt", required=True, help="the text to complete")
    add_engine_args(gen)
    add_sampling_args(gen, model_defaults=False)


def _add_chat(sub) -> None:
    chat = add_command(sub, "chat", "chat with the model in the terminal", cmd_chat)
    chat.epilog = f"At the prompt: {CHAT_USAGE}."
    chat.add_argument("--system", default=None,
                      help="a system message that opens the conversation, kept by /reset "
                           "(default: none)")
    add_engine_args(chat)
    add_sampling_args(chat, model_defaults=True)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)     # bad flags exit 2 here, before any import
    if getattr(args, "enable_runtime_lora", False) and not (args.enable_lora and args.lora_root):
        parser.error("--enable-runtime-lora needs --enable-lora and at least one --lora-root "
                     "DIR (the folders adapters may be loaded from)")
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


def _generation_config(text: str) -> str:
    if text in ("auto", "vllm") or os.path.isfile(os.path.join(text, "generation_config.json")):
        return text
    raise argparse.ArgumentTypeError(f"auto, vllm or a folder holding generation_config.json, "
                                     f"got {text!r}")


def _lora_module(text: str) -> tuple[str, str]:
    from folio.server.lora_routes import check_adapter_name, parse_lora_module
    try:
        name, path = parse_lora_module(text)
        check_adapter_name(name)
        return name, path
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


if __name__ == "__main__":
    sys.exit(main())

