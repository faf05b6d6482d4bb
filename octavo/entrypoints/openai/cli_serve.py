"""`octavo serve`: its command-line options, and starting uvicorn on the app.

Kept apart from api_server so that building the `octavo` parser imports no web framework.
"""

from __future__ import annotations

import argparse
import logging
import os

from octavo.checkpoint.embedded import EMBEDDED_MODEL_NAME
from octavo.config import DEFAULT_KV_IDLE_RELEASE_S
from octavo.engine.spawn import start_engine_process
from octavo.entrypoints.cli_args import (
    add_load_args,
    add_parallel_args,
    add_step_args,
    announce_threads,
    engine_options,
    positive_int,
)
from octavo.entrypoints.openai.limits import DEFAULT_MAX_REQUEST_BYTES

API_KEY_ENV = "OCTAVO_API_KEY"


def add_parser(sub) -> None:
    """Registers `octavo serve` on the CLI's subparsers."""
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    p.add_argument(
        "--model", default=None,
        help="GGUF file, HF dir, hub id (org/name, org/name:QUANT), or bundled config name",
    )  # fmt: skip
    p.add_argument("--revision", default=None, help="the hub model's branch, tag or commit")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as `model` (default: the model's name)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=positive_int, default=8000, help="port to listen on")
    p.add_argument(
        "--api-key", default=None,
        help="require `Authorization: Bearer <key>` on every route but /health and /metrics "
        f"(default: ${API_KEY_ENV}, which keeps the key out of the process list)",
    )  # fmt: skip
    p.add_argument(
        "--api-key-metrics", action="store_true", help="require the API key on /metrics too"
    )
    p.add_argument(
        "--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
        help="refuse a request body larger than this with a 413 (default: 4 MiB)",
    )  # fmt: skip
    p.add_argument(
        "--restart", action=argparse.BooleanOptionalAction, default=True,
        help="start the engine again when its process dies (up to 3 times in a row, with "
        "backoff); with --no-restart the server exits with status 1 instead",
    )  # fmt: skip
    p.add_argument(
        "--shutdown-timeout", type=_non_negative_float, default=30.0,
        help="seconds that requests in flight get to finish after SIGTERM or Ctrl-C; the rest "
        "then fail (streams with an error event); a second signal exits at once",
    )  # fmt: skip
    _add_engine_args(p)
    p.add_argument(
        "--kv-idle-release", type=_non_negative_float, default=DEFAULT_KV_IDLE_RELEASE_S,
        metavar="SECONDS", help="on the CPU, after this long idle, give the memory of free KV "
        "blocks back to the system, forgetting their cached prefixes (0: never)",
    )  # fmt: skip
    p.add_argument(
        "--engine-in-thread", action="store_true",
        help="step the engine on a thread of the server's process, not in a process of its own",
    )  # fmt: skip
    p.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"],
        help="the server's log level",
    )  # fmt: skip
    p.set_defaults(func=cmd_serve)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's options, as build_engine takes them."""
    add_load_args(p)
    add_step_args(p, "8192 on a GPU, 128 on the CPU")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens a KV block holds")
    p.add_argument(
        "--num-kv-blocks", type=positive_int, default=None,
        help="KV blocks to allocate (default: what the memory budget holds)",
    )  # fmt: skip
    p.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="reuse the KV blocks of prompts' common prefixes",
    )  # fmt: skip
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the sampler of requests without a seed, and dummy weights",
    )
    _add_chat_args(p)
    add_parallel_args(p, nodes=True)


def _add_chat_args(p: argparse.ArgumentParser) -> None:
    from octavo.entrypoints.reasoning import REASONING_PARSERS
    from octavo.entrypoints.tool_calls import TOOL_CALL_PARSERS

    p.add_argument(
        "--chat-template", default=None, metavar="FILE",
        help="a jinja2 chat template to use instead of the model's",
    )  # fmt: skip
    p.add_argument(
        "--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
        help="how the model writes tool calls (auto: from the chat template)",
    )  # fmt: skip
    p.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help='accepted for vLLM\'s sake: tool_choice "auto" is always on with tools',
    )  # fmt: skip
    p.add_argument(
        "--reasoning-parser", default=None, choices=REASONING_PARSERS,
        help="put the model's <think> text in `reasoning_content` (auto: from the template)",
    )  # fmt: skip


def _chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise SystemExit(f"octavo serve: error: --chat-template {path}: {e.strerror}") from None


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $OCTAVO_API_KEY; an empty value means no key."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def default_model_name(model: str | None) -> str:
    """The embedded model's name, else the --model argument as given (as vLLM does)."""
    return EMBEDDED_MODEL_NAME if model is None else model


def _give_large_blocks_back() -> None:
    """glibc's malloc raises its mmap threshold each time a large block is freed (up to 32
    MiB), after which a large request's buffers come from the heap and stay with the process.
    Fixed thresholds keep every block of 1 MiB or more in a mapping of its own, unmapped when
    freed, and trim the heap's top past 4 MiB. Only the server's process: the spawned engine
    process keeps glibc's defaults. Not glibc: nothing to set."""
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 1 << 20)
    mallopt(m_trim_threshold, 4 << 20)


def cmd_serve(args: argparse.Namespace) -> int:
    if not args.engine_in_thread:  # an engine here would map and fault in its large tensors
        _give_large_blocks_back()
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    template = _chat_template(args.chat_template)  # before anything starts
    names = ("model", "revision", "block_size", "num_kv_blocks", "enable_prefix_caching", "seed")
    options = {name: getattr(args, name) for name in names} | engine_options(args)
    idle = {"kv_idle_release_s": args.kv_idle_release}
    if args.node_rank > 0:  # a worker node: no engine, no API
        from octavo.config import ParallelConfig
        from octavo.runner.multiproc import launch_node

        ParallelConfig(args.tensor_parallel_size, args.nnodes, args.dist_init_addr)
        print(f"octavo: node {args.node_rank} of {args.nnodes}, workers for node 0 at "
              f"{args.dist_init_addr}", flush=True)  # fmt: skip
        return launch_node(args.tensor_parallel_size, args.nnodes, args.node_rank,
                           args.dist_init_addr)  # fmt: skip
    # The engine process starts before this process imports the server and the engine's
    # modules, so that the two processes' imports overlap.
    started = None if args.engine_in_thread else start_engine_process(options | idle)
    import uvicorn

    from octavo.engine.async_engine import AsyncEngine
    from octavo.engine.builder import build_engine, resolve_device
    from octavo.engine.engine_process import EngineProcess
    from octavo.entrypoints.openai.api_server import build_app
    from octavo.entrypoints.openai.lifecycle import Server
    from octavo.entrypoints.openai.serving import ChatOptions

    if resolve_device(args.device).type == "cpu":
        announce_threads(args.threads)
    if args.engine_in_thread:  # on the thread that will step it (see AsyncEngine.build)
        engine = AsyncEngine.build(lambda: build_engine(**options), **idle)
    else:
        engine = EngineProcess.start_process(started, **options, **idle)
    name = args.served_model_name or default_model_name(args.model)
    app = build_app(
        engine,
        name,
        api_key=api_key(args),
        api_key_metrics=args.api_key_metrics,
        max_request_bytes=args.max_request_bytes,
        chat=ChatOptions(args.tool_call_parser, args.reasoning_parser),
        chat_template=template,
    )
    print(f"octavo: serving {name} on http://{args.host}:{args.port}/v1", flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    server = Server(
        config, engine, restart_engine=args.restart, shutdown_timeout=args.shutdown_timeout
    )
    server.run()
    return server.exit_code
