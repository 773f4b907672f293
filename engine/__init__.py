"""Generation engine: static KV cache, greedy and sampled decoding, speculative decoding."""

from .api import (
    GenerationResult,
    generate,
    generate_batch,
    make_generator,
    make_proposer,
    stream,
    warm_up,
)
from .batch import BatchGenerator, SequencesGenerator
from .config import GenAIConfig, SearchOptions, load_config
from .generator import Generator
from .logprobs import TokenLogprob
from .model import GeneratorParams, Model
from .proposers import DraftModelProposer, MTPProposer, PromptLookupProposer, Proposer
from .scheduler import RequestHandle, RequestResult, Scheduler, TokenEvent
from .speculative import SpeculativeGenerator
from .tokenizer import Tokenizer

__all__ = [
    "BatchGenerator",
    "RequestHandle",
    "RequestResult",
    "Scheduler",
    "TokenEvent",
    "generate_batch",
    "DraftModelProposer",
    "GenAIConfig",
    "GenerationResult",
    "Generator",
    "GeneratorParams",
    "MTPProposer",
    "Model",
    "PromptLookupProposer",
    "Proposer",
    "SearchOptions",
    "SequencesGenerator",
    "SpeculativeGenerator",
    "TokenLogprob",
    "Tokenizer",
    "generate",
    "load_config",
    "make_generator",
    "make_proposer",
    "stream",
    "warm_up",
]
