"""Sessions: load, plan and run ONNX models."""

from .binding import IOBinding
from .executor import Executor, SlotStats
from .inference_session import InferenceSession
from .loader import load_model

__all__ = ["Executor", "IOBinding", "InferenceSession", "SlotStats", "load_model"]
