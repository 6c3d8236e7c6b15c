"""The lmforge model: a Llama-style GPT, KV-cache generation, Hugging Face export/import."""

from lmforge.model.generate import (
           KVCache,
           NonFiniteLogits,
           SamplingError,
           SamplingParams,
           generate,
           stream,
)
from lmforge.model.model import GPT, ModelConfig

__all__ = ["GPT", "KVCache", "ModelConfig", "NonFiniteLogits", "SamplingError", "SamplingParams",
           "generate", "stream"]
