"""Sessions: load, plan and run ONNX models."""

from .binding import IOBinding
from .executor import Executor, SlotStats
from .inference_session import InferenceSession
from .loader import LoadedModel, load_model, open_model

__all__ = [
    "Executor",
    "IOBinding",
    "InferenceSession",
    "LoadedModel",
    "SlotStats",
    "load_model",
    "open_model",
]
