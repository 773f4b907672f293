"""Read an onnxruntime-genai style ``genai_config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnx_genrt.core.errors import ModelLoadError


@dataclass(frozen=True)
class DecoderIO:
    """Names of the decoder's inputs and outputs; ``%d`` in KV names is the layer index."""

    input_ids: str = "input_ids"
    attention_mask: str | None = "attention_mask"
    position_ids: str | None = None
    past_key: str = "past_key_values.%d.key"
    past_value: str = "past_key_values.%d.value"
    logits: str = "logits"
    present_key: str = "present.%d.key"
    present_value: str = "present.%d.value"
    hidden_states: str | None = None


@dataclass(frozen=True)
class SearchOptions:
    """Decoding options; defaults come from the config's ``search`` section."""

    max_length: int = 256
    min_length: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None


@dataclass(frozen=True)
class GenAIConfig:
    """The parts of genai_config.json that onnx-genrt uses."""

    folder: Path
    model_type: str
    filename: str
    io: DecoderIO
    num_layers: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    vocab_size: int
    context_length: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    search: SearchOptions
    speculative: dict[str, Any] = field(default_factory=dict)

    @property
    def model_path(self) -> Path:
        return self.folder / self.filename


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


SPECULATIVE_FILE = "speculative.json"


def _speculative(folder: Path) -> dict[str, Any]:
    """Proposers shipped beside the model (``speculative.json``; onnxruntime-genai refuses
    unknown keys in genai_config.json, so they live in a file of their own)."""
    path = folder / SPECULATIVE_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def load_config(folder: str | Path) -> GenAIConfig:
    """Parse ``folder/genai_config.json``; errors name the file and the missing key."""
    folder = Path(folder)
    path = folder / "genai_config.json"
    if not path.is_file():
        raise ModelLoadError(f"no genai_config.json in {folder}")
    try:
        raw = json.loads(path.read_text())
        model = raw["model"]
        dec = model["decoder"]
        inputs, outputs = dec.get("inputs", {}), dec.get("outputs", {})
        io = DecoderIO(
            input_ids=inputs.get("input_ids", "input_ids"),
            attention_mask=inputs.get("attention_mask"),
            position_ids=inputs.get("position_ids"),
            past_key=inputs.get("past_key_names", DecoderIO.past_key),
            past_value=inputs.get("past_value_names", DecoderIO.past_value),
            logits=outputs.get("logits", "logits"),
            present_key=outputs.get("present_key_names", DecoderIO.present_key),
            present_value=outputs.get("present_value_names", DecoderIO.present_value),
            hidden_states=outputs.get("hidden_states"),
        )
        s = raw.get("search", {})
        search = SearchOptions(
            max_length=int(s.get("max_length", model.get("context_length", 256))),
            min_length=int(s.get("min_length", 0)),
            do_sample=bool(s.get("do_sample", False)),
            temperature=float(s.get("temperature", 1.0)),
            top_k=int(s.get("top_k", 0)),
            top_p=float(s.get("top_p", 1.0)),
            min_p=float(s.get("min_p", 0.0)),
            repetition_penalty=float(s.get("repetition_penalty", 1.0)),
        )
        return GenAIConfig(
            folder=folder,
            model_type=str(model.get("type", "")),
            filename=dec.get("filename", "model.onnx"),
            io=io,
            num_layers=int(dec["num_hidden_layers"]),
            num_kv_heads=int(dec["num_key_value_heads"]),
            head_size=int(dec["head_size"]),
            hidden_size=int(dec["hidden_size"]),
            vocab_size=int(model["vocab_size"]),
            context_length=int(model.get("context_length", search.max_length)),
            eos_token_ids=_ids(model.get("eos_token_id")),
            bos_token_id=model.get("bos_token_id"),
            pad_token_id=model.get("pad_token_id"),
            search=search,
            speculative=_speculative(folder),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing key {exc}") from None
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
