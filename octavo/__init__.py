"""octavo: a readable LLM inference engine with a paged KV cache."""

from octavo.engine.beam_search import BeamSearchParams
from octavo.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    RequestOutput,
)
from octavo.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from octavo.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'octavo' has no attribute {name!r}")
