"""Read an onnxruntime-genai style ``genai_config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnx_genrt.core.checks import check_int
from onnx_genrt.core.errors import ModelLoadError
from onnx_genrt.core.paths import resolve_inside

from .sampling import validate


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
    #: OpenAI's additive penalties over the tokens generated after the prompt: a token's
    #: logit minus ``frequency_penalty`` times its count and ``presence_penalty`` once.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: Added to the logits of these token ids before every pick: {id: bias} (a mapping is
    #: accepted; kept as sorted (id, bias) pairs). -100 bans a token in practice.
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    #: Sequences a :class:`~onnx_genrt.engine.Generator` holds (one row each); see
    #: :class:`~onnx_genrt.engine.batch.SequencesGenerator`.
    batch_size: int = 1


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


def _section(
    parent: dict[str, Any], key: str, path: Path, where: str = "", required: bool = False
) -> dict[str, Any]:
    """``parent[key]`` as a JSON object ({} when absent and not required)."""
    if key not in parent and not required:
        return {}
    value = parent[key]  # a missing required key: KeyError, reported by load_config
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: {where}{key} must be an object, got {type(value).__name__}")
    return value


def _name(section: dict[str, Any], key: str, default: str | None, where: str) -> str | None:
    """A graph input or output name; ``%d`` names (per-layer KV) must contain ``%d``."""
    value = section.get(key, default)
    if value is None and default is None:
        return None
    if not isinstance(value, str) or not value:
        raise ModelLoadError(f"{where}{key} must be a non-empty name, got {value!r}")
    if key.endswith("_names") and value.count("%d") != 1:
        raise ModelLoadError(f"{where}{key} must contain %d once (the layer index), got {value!r}")
    return value


def _decoder_io(inputs: dict[str, Any], outputs: dict[str, Any], path: Path) -> DecoderIO:
    """The decoder's input and output names from ``model.decoder.inputs`` / ``outputs``."""
    i, o = f"{path}: model.decoder.inputs.", f"{path}: model.decoder.outputs."
    return DecoderIO(
        input_ids=_name(inputs, "input_ids", "input_ids", i),
        attention_mask=_name(inputs, "attention_mask", None, i),
        position_ids=_name(inputs, "position_ids", None, i),
        past_key=_name(inputs, "past_key_names", DecoderIO.past_key, i),
        past_value=_name(inputs, "past_value_names", DecoderIO.past_value, i),
        logits=_name(outputs, "logits", "logits", o),
        present_key=_name(outputs, "present_key_names", DecoderIO.present_key, o),
        present_value=_name(outputs, "present_value_names", DecoderIO.present_value, o),
        hidden_states=_name(outputs, "hidden_states", None, o),
    )


def _count(
    parent: dict[str, Any], key: str, path: Path, where: str = "model.", default: Any = ...
) -> Any:
    """A positive integer entry (a whole-number float such as 1e9 is accepted)."""
    if key not in parent and default is not ...:
        return default
    return check_int(
        parent[key], f"{path}: {where}{key}", minimum=1, integral_floats=True, error=ModelLoadError
    )


def _optional_id(value: Any, name: str, path: Path) -> int | None:
    if value is None:
        return None
    return check_int(value, f"{path}: {name}", minimum=0, error=ModelLoadError)


def _ids(value: Any, name: str, path: Path, vocab_size: int) -> tuple[int, ...]:
    """Token ids given as one id or a list, each in ``[0, vocab_size)``."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(
        check_int(v, f"{path}: {name}", minimum=0, maximum=vocab_size - 1, error=ModelLoadError)
        for v in values
    )


#: The search options genai_config.json's ``search`` section may set (others, such as
#: ``num_beams``, are onnxruntime-genai's and ignored; ``seed`` is set per generation).
CONFIG_SEARCH_KEYS = (
    "max_length",
    "min_length",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
)


def _search(section: dict[str, Any], context: int | None, path: Path) -> SearchOptions:
    """The ``search`` section over :class:`SearchOptions`' defaults, checked; ``max_length``
    defaults to the context length, and one of the two must be given."""
    given = {key: section[key] for key in CONFIG_SEARCH_KEYS if key in section}
    if "max_length" not in given:
        if context is None:
            raise ModelLoadError(
                f"{path}: model.context_length is missing (and search.max_length too); "
                "set model.context_length to the number of positions the model was trained for"
            )
        given["max_length"] = context
    return validate(
        SearchOptions(**given), error=ModelLoadError, where=f"{path}: search.", from_json=True
    )


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
        for key in ("inputs", "outputs"):
            names = _section(value, key, folder / SPECULATIVE_FILE, f"{section}.")
            for name, graph_name in names.items():
                if not isinstance(graph_name, str) or not graph_name:
                    raise ModelLoadError(
                        f"{folder / SPECULATIVE_FILE}: {section}.{key}.{name} must be a "
                        f"non-empty name, got {graph_name!r}"
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
        model = _section(raw, "model", path, required=True)
        dec = _section(model, "decoder", path, "model.", required=True)
        inputs = _section(dec, "inputs", path, "model.decoder.")
        outputs = _section(dec, "outputs", path, "model.decoder.")
        io = _decoder_io(inputs, outputs, path)
        context = _count(model, "context_length", path, default=None)
        search = _search(_section(raw, "search", path), context, path)
        vocab_size = _count(model, "vocab_size", path)
        return GenAIConfig(
            folder=folder,
            model_type=str(model.get("type", "")),
            filename=_filename(dec.get("filename", "model.onnx"), path),
            io=io,
            num_layers=_count(dec, "num_hidden_layers", path, "model.decoder."),
            num_kv_heads=_count(dec, "num_key_value_heads", path, "model.decoder."),
            head_size=_count(dec, "head_size", path, "model.decoder."),
            hidden_size=_count(dec, "hidden_size", path, "model.decoder."),
            vocab_size=vocab_size,
            context_length=context if context is not None else search.max_length,
            eos_token_ids=_ids(model.get("eos_token_id"), "model.eos_token_id", path, vocab_size),
            bos_token_id=_optional_id(model.get("bos_token_id"), "model.bos_token_id", path),
            pad_token_id=_optional_id(model.get("pad_token_id"), "model.pad_token_id", path),
            search=search,
            speculative=_speculative(folder),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing key {exc}") from None
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
