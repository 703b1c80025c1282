"""The model's own sampling defaults, from its ``generation_config.json``, as vLLM reads them.

vLLM's ``generation_config`` engine argument: ``"auto"`` (the default) reads the model
directory's ``generation_config.json``, a folder path reads that folder's, ``"vllm"``
reads none. Of the file, only what changes sampling is kept, under
:class:`~inflight.sampling_params.SamplingParams` names: ``repetition_penalty``,
``temperature``, ``top_k``, ``top_p``, ``min_p``, and ``max_new_tokens`` as ``max_tokens``
(vLLM's ``get_diff_sampling_param``). ``override_generation_config`` is laid over it,
with the same names (any other key is refused by name). These become the defaults of a request that does not set them:
``LLM.generate`` without ``sampling_params`` and every server request that leaves a field
out. A GGUF file carries no generation config; ``"auto"`` finds none there.

Pure Python (no torch).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field
_SAMPLING_KEYS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(
    model_path: str,
    generation_config: str = "auto",
    override_generation_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The sampling defaults (SamplingParams field -> value) for the model at
    ``model_path``; raises ``ValueError`` for an unreadable file or a folder without
    one."""
    if not isinstance(generation_config, str) or not generation_config:
        raise ValueError(
            "generation_config must be 'auto', 'vllm' or a folder holding a "
            f"generation_config.json, got {generation_config!r}"
        )
    if override_generation_config is not None and not isinstance(override_generation_config, Mapping):
        raise ValueError(
            "override_generation_config must be a dict of generation config fields, got "
            f"{type(override_generation_config).__name__}"
        )
    unknown = sorted(set(override_generation_config or {}) - set(_SAMPLING_KEYS), key=str)
    if unknown:  # vLLM drops them unread; a typo here would change nothing, silently
        raise ValueError(
            f"override_generation_config: unknown field(s) {unknown}: only "
            f"{sorted(_SAMPLING_KEYS)} change sampling"
        )
    found: Mapping[str, Any] = {}
    if generation_config == "auto":
        folder = Path(model_path)
        if folder.is_dir():
            found = _read(folder / "generation_config.json", required=False)
    elif generation_config != "vllm":
        found = _read(Path(generation_config) / "generation_config.json", required=True)
    merged = {**found, **(override_generation_config or {})}
    defaults = {field: merged[key] for key, field in _SAMPLING_KEYS.items()
                if merged.get(key) is not None}
    if defaults:
        logger.info("sampling defaults from the generation config: %s (generation_config="
                    "'vllm' ignores the model's)", defaults)
    return defaults


def _read(path: Path, required: bool) -> Mapping[str, Any]:
    if not path.is_file():
        if required:
            raise ValueError(f"generation_config: no generation_config.json in {path.parent}")
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"generation_config: cannot read {path}: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"generation_config: {path} does not hold a JSON object")
    return config
