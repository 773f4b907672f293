"""Read an onnxruntime-genai style ``genai_config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnx_genrt.core.errors import ModelLoadError
from onnx_genrt.core.paths import resolve_inside


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
        """The decoder's file, resolved inside the folder (refused if it leaves it)."""
        return resolve_inside(self.folder, self.filename, f"{CONFIG_FILE}: model.decoder.filename")

    def path_of(self, name: Any, key: str) -> Path:
        """Any other file the folder names (``key`` says which entry), inside the folder."""
        return resolve_inside(self.folder, name, key)


def _filename(value: Any, path: Path) -> str:
    if not isinstance(value, str) or not value:
        raise ModelLoadError(f"{path}: model.decoder.filename must be a file name, got {value!r}")
    return value


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


CONFIG_FILE = "genai_config.json"
SPECULATIVE_FILE = "speculative.json"


def read_json_object(folder: Path, name: str) -> dict[str, Any] | None:
    """``folder/name`` parsed as a JSON object (None when absent); the file must resolve
    inside the folder, and every problem is a :class:`ModelLoadError` naming the file."""
    path = resolve_inside(folder, name, name)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _speculative(folder: Path) -> dict[str, Any]:
    """Proposers shipped beside the model (``speculative.json``; onnxruntime-genai refuses
    unknown keys in genai_config.json, so they live in a file of their own). Each section
    (``mtp``, ``draft``, ...) must be an object."""
    data = read_json_object(folder, SPECULATIVE_FILE) or {}
    for section, value in data.items():
        if not isinstance(value, dict):
            raise ModelLoadError(
                f"{folder / SPECULATIVE_FILE}: section {section!r} must be an object, "
                f"got {type(value).__name__}"
            )
    return data


def load_config(folder: str | Path) -> GenAIConfig:
    """Parse ``folder/genai_config.json``; errors name the file and the missing key."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    raw = read_json_object(folder, CONFIG_FILE)
    if raw is None:
        raise ModelLoadError(f"no {CONFIG_FILE} in {folder}")
    try:
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
            filename=_filename(dec.get("filename", "model.onnx"), path),
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
