"""The `octavo` command: generate, chat, bench."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterator

from octavo.sampling_params import RequestOutputKind, SamplingParams


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file, HF dir, or bundled config name")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)


def _llm(args: argparse.Namespace):
    from octavo.entrypoints.llm import LLM

    return LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        load_format=args.load_format,
    )


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = list(args.prompt)
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("give a prompt or --file")
    llm = _llm(args)
    params = _params(args)
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        if len(prompts) > 1:
            print(f"=== {prompt}")
        print(out.outputs[0].text)
    return 0


def stream_chat_reply(llm, conversation: list[dict], params: SamplingParams) -> Iterator[str]:
    """Yields the assistant's reply to `conversation` piece by piece as it is generated."""
    from octavo.model.tokenizer import apply_chat_template

    engine = llm.engine
    ids = apply_chat_template(engine.tokenizer, conversation)
    params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    request = engine.add_request(ids, params)
    try:
        while not request.is_finished:
            for out in engine.step():
                if out.request_id == request.request_id and out.outputs[0].text:
                    yield out.outputs[0].text
    finally:
        if not request.is_finished:
            engine.abort_request(request.request_id)


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _llm(args)
    params = _params(args)
    conversation: list[dict] = []
    if args.system:
        conversation.append({"role": "system", "content": args.system})
    print("octavo chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits.")
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
    parser = argparse.ArgumentParser(prog="octavo", description="octavo LLM inference engine")
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
        return 2


if __name__ == "__main__":
    sys.exit(main())
