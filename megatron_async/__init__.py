"""megatron_async: dynamic-batching LLM inference whose GPU never waits for its CPU."""
from megatron_async.config import InferenceConfig
from megatron_async.inference.request import InvalidRequestError, RequestOutput, RequestUpdate, SamplingParams
from megatron_async.llm import LLM

__all__ = ["LLM", "SamplingParams", "InferenceConfig", "RequestOutput", "RequestUpdate", "InvalidRequestError"]
__version__ = "0.1.0"
