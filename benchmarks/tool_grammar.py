"""What a tool-call grammar costs a decode step on the CPU, against plain decoding and a JSON
schema's structured output, the same requests in the same run: the embedded model, B chat
requests at once, the median decode step while all of them run.

    python benchmarks/tool_grammar.py --batch 1 16 --tokens 48
"""

from __future__ import annotations

import argparse
import time

from octavo import LLM, SamplingParams, StructuredOutputsParams
from octavo.entrypoints.tool_calls import HERMES, check_tools, tool_grammar

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
]  # fmt: skip
SCHEMA = TOOLS[0]["function"]["parameters"]


def timed(llm: LLM, batch: int, tokens: int, constraint) -> float:
    """Seconds per decode step while all `batch` requests run (prefill steps excluded)."""
    from octavo.tokenizer.tokenizer import apply_chat_template

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                            structured_outputs=constraint)  # fmt: skip
    engine = llm.engine
    for i in range(batch):
        chat = [{"role": "user", "content": f"Weather in city {i}?"}]
        engine.add_request(apply_chat_template(llm.get_tokenizer(), chat), params)
    times = []
    while engine.has_unfinished_requests():
        full = len(engine.scheduler.running) == batch and not engine.scheduler.waiting
        decoding = full and all(r.output_token_ids for r in engine.scheduler.running)
        start = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]  # the median step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--tokens", type=int, default=48)
    args = p.parse_args()
    llm = LLM()
    functions = check_tools(TOOLS)
    settings = {
        "plain": None,
        "JSON schema": StructuredOutputsParams(json=SCHEMA),
        "tools, required": StructuredOutputsParams(
            grammar=tool_grammar(HERMES, functions, "required", None, parallel=True)),
        "tools, auto": StructuredOutputsParams(
            grammar=tool_grammar(HERMES, functions, "auto", None, parallel=True)),
    }  # fmt: skip
    timed(llm, 2, 8, settings["tools, required"])  # warm-up
    print(f"{'batch':>6} {'constraint':<16}{'ms a step':>10}{'x plain':>9}")
    for batch in args.batch:
        plain = None
        for name, constraint in settings.items():
            seconds = min(timed(llm, batch, args.tokens, constraint) for _ in range(2))
            plain = plain or seconds
            print(f"{batch:>6} {name:<16}{seconds * 1e3:>10.1f}{seconds / plain:>9.2f}")


if __name__ == "__main__":
    main()
