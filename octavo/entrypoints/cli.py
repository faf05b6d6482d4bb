"""The `octavo` command: generate, chat, bench, serve.

Every option is checked before the model loads, so a mistake fails at once with one line.
Text streams to stdout as the engine produces it. Ctrl-C is taken between engine steps
(never in the middle of one): `generate` prints what it has and exits 130; `chat` stops the
reply and returns to the prompt, where Ctrl-C or Ctrl-D leaves.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Self

from octavo import __version__
from octavo.entrypoints.cli_args import (
    Parser,
    add_load_args,
    add_parallel_args,
    announce_threads,
    engine_options,
    positive_int,
)
from octavo.sampling_params import RequestOutputKind, SamplingParams

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a process stopped by Ctrl-C


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="a GGUF file, an HF directory, a hub id (org/name) or a bundled config name "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--revision", default=None, help="the hub model's branch, tag or commit")
    add_load_args(p)
    add_parallel_args(p)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=256, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's mass")
    p.add_argument(
        "--top-k", type=int, default=None, help="sample among the k likeliest (default: all)"
    )
    p.add_argument(
        "--seed", type=int, default=None, help="for reproducible sampling (default: random)"
    )


def _llm(args: argparse.Namespace):
    _check_device(args.device)
    from octavo.entrypoints.llm import LLM

    llm = LLM(args.model, revision=args.revision, **engine_options(args))
    if llm.engine.runner.device.type == "cpu":
        announce_threads(args.threads)
    return llm


_SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "seed")


def _params(args: argparse.Namespace) -> SamplingParams:
    """The sampling options as SamplingParams; a bad one is a ValueError naming its flag."""
    try:
        return SamplingParams(**{name: getattr(args, name) for name in _SAMPLING_FLAGS})
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        if name not in _SAMPLING_FLAGS:
            raise
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"argument {flag}: {str(e)[len(name) + 1 :]} (see --help)") from None


def _check_device(device: str) -> None:
    kind, _, index = device.partition(":")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")


def _prompts(args: argparse.Namespace) -> list[str]:
    """The prompts from the command line, then from --file (one per non-empty line)."""
    prompts = list(args.prompt)
    if args.file:
        try:
            with open(args.file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise ValueError(f"--file {args.file}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise ValueError(f"--file {args.file}: not UTF-8 text") from None
    if not prompts:
        raise ValueError("give a prompt or --file")
    return prompts


class _CtrlC:
    """Within `with`, Ctrl-C sets `requested` instead of raising, so the engine loop can stop
    between two steps and leave the engine usable; a second Ctrl-C raises at once. Outside
    the main thread, where signal handlers cannot be set, Ctrl-C is left alone."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True


def stream_generation(
    engine, prompts: list[str | list[int]], params: SamplingParams
) -> Iterator[tuple[int, str, bool]]:
    """Runs the prompts as one batch and yields (prompt index, new text, finished) as the
    engine produces text. Ctrl-C ends the iteration after the step in flight; the unfinished
    requests are aborted then, and whenever the caller stops iterating.

    Raises:
        ValueError: a bad prompt; nothing is queued then.
    """
    params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    index: dict[str, int] = {}
    try:
        for i, prompt in enumerate(prompts):
            index[engine.add_request(prompt, params).request_id] = i
        with _CtrlC() as ctrl_c:
            while index and not ctrl_c.requested:
                for out in engine.step():
                    if out.request_id in index:
                        rid = out.request_id
                        i = index.pop(rid) if out.finished else index[rid]
                        yield i, out.outputs[0].text, out.finished
    finally:
        if index:
            engine.abort_request(list(index))


def stream_chat_reply(llm, conversation: list[dict], params: SamplingParams) -> Iterator[str]:
    """Yields the assistant's reply to `conversation` piece by piece as it is generated;
    Ctrl-C ends it early."""
    from octavo.tokenizer.tokenizer import apply_chat_template

    ids = apply_chat_template(llm.engine.tokenizer, conversation)
    for _, text, _ in stream_generation(llm.engine, [ids], params):
        if text:
            yield text


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = _prompts(args)
    params = _params(args)
    llm = _llm(args)
    inputs: list[str | list[int]] = list(prompts)
    if args.chat:
        from octavo.tokenizer.tokenizer import apply_chat_template

        tokenizer = llm.engine.tokenizer
        inputs = [apply_chat_template(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    texts = [""] * len(prompts)
    finished = [False] * len(prompts)
    single = len(prompts) == 1
    printed = 0  # several prompts print in order, each once it has finished
    try:
        for i, text, done in stream_generation(llm.engine, inputs, params):
            texts[i] += text
            finished[i] = done
            if single:
                print(text, end="", flush=True)
            while not single and printed < len(prompts) and finished[printed]:
                _print_result(prompts[printed], texts[printed])
                printed += 1
    except KeyboardInterrupt:  # a second Ctrl-C, in the middle of a step
        pass
    if single:
        print()
    else:
        for i in range(printed, len(prompts)):  # what Ctrl-C cut short
            _print_result(prompts[i], texts[i])
    if not all(finished):
        print("octavo: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _print_result(prompt: str, text: str) -> None:
    print(f"=== {prompt}")
    print(text, flush=True)


def cmd_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    llm = _llm(args)
    conversation: list[dict] = []
    if args.system:
        conversation.append({"role": "system", "content": args.system})
    print(
        "octavo chat: type a message; /reset clears the conversation. Ctrl-C stops a reply; "
        "/exit, Ctrl-D or Ctrl-C at the prompt quits."
    )
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            conversation = conversation[:1] if args.system else []
            continue
        if not line.strip():
            continue
        conversation.append({"role": "user", "content": line})
        reply = ""
        for piece in stream_chat_reply(llm, conversation, params):
            reply += piece
            print(piece, end="", flush=True)
        print()
        conversation.append({"role": "assistant", "content": reply})


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="octavo", description="octavo LLM inference engine")
    parser.add_argument("--version", action="version", version=f"octavo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts")
    gen.add_argument("prompt", nargs="*", help="prompt text (several allowed)")
    gen.add_argument("--file", help="a file with one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="an interactive chat with the model")
    chat.add_argument("--system", default=None, help="a system prompt")
    _add_model_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    from octavo.entrypoints.openai import cli_serve

    cli_serve.add_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from octavo.entrypoints import bench_serve, bench_throughput

    bench_throughput.add_parser(bench_sub)
    bench_serve.add_parser(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"octavo: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # while loading, say
        print("\noctavo: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
