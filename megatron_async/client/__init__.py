"""A client of the engines behind a data-parallel coordinator, from any process:
``InferenceClient`` (asyncio) and ``SyncInferenceClient`` (the same from synchronous code).
Imports no torch."""
from megatron_async.client.client import (
    ControlError, CoordinatorLost, InferenceClient, RequestFuture, RequestStream,
)
from megatron_async.client.sync import SyncInferenceClient
from megatron_async.coordinator.transport import AuthError

__all__ = ["InferenceClient", "SyncInferenceClient", "RequestFuture", "RequestStream", "ControlError",
           "CoordinatorLost", "AuthError"]
