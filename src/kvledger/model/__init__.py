"""Model core: loading, the Llama-family forward over a paged KV pool, attention backends, sampling."""

from .batch import ForwardBatch
from .config import ModelConfig
from .llama import LlamaModel
from .loader import LoadedModel, default_model_path, load_model
from .sampler import Sampler, SampleResult
from .sampler_device import DeviceSampler

__all__ = [
    "DeviceSampler",
    "ForwardBatch",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "SampleResult",
    "Sampler",
    "default_model_path",
    "load_model",
]
