"""Model core: loading, the model families (``models/``) on shared layers (``layers/``) over a paged KV
pool, attention backends, sampling."""

from .batch import ForwardBatch
from .causal_lm import CausalLM, LlamaModel
from .config import ModelConfig
from .loader import LoadedModel, default_model_path, load_model
from .sampler import Sampler, SampleResult
from .sampler_device import DeviceSampler

__all__ = [
    "CausalLM",
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
