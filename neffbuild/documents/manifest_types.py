"""The field types and limits a manifest's models share: exact types, bounded sizes, frozen models
that reject unknown keys (documents/manifest.py, documents/compile_recipe.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict

from neffbuild import descriptors

Dtype = Literal["float32", "bfloat16", "float16"]
if TYPE_CHECKING:
    BackendName = str
    Device = str
else:  # the registry's, as literals: pydantic checks them and the schema lists them (enum)
    BackendName = Literal[descriptors.names()]
    Device = Literal[descriptors.devices()]
Mode = Literal["eager", "full", "regional"]

# Limits (docs/manifest.md, "Types and limits"): far above any real manifest, low enough that a typo such as an extra
# zero, or a hostile file, fails here instead of in a worker or a key computation.
MAX_SIDE = 16384  # pixels, height and width
MAX_IMAGES = 256  # images per call: batch x prompts
MAX_LIST = 256  # items in any list of the manifest
MAX_UNITS = 1024  # units (shapes) per manifest
MAX_TENSOR_PARALLEL = 128
MAX_TEXT = 16384  # characters in one string value
MAX_PATH = 4096  # characters in a model path or store URL (PATH_MAX)
MAX_NAME_PART = 255  # bytes in one path component (NAME_MAX)
MAX_DEPTH = 8  # nesting of tables and arrays; a real manifest needs 5
MAX_INT = 2**63 - 1  # call argument integers (what TOML promises)

Side = Annotated[int, Strict(), Field(ge=1, le=MAX_SIDE)]
Batch = Annotated[int, Strict(), Field(ge=1, le=MAX_IMAGES)]
Text = Annotated[str, Field(max_length=MAX_TEXT)]
CallInt = Annotated[int, Strict(), Field(ge=-MAX_INT, le=MAX_INT)]
CallFloat = Annotated[float, Strict(), Field(allow_inf_nan=False)]
Scalar = Annotated[bool, Strict()] | CallInt | CallFloat | Text
CallValue = Scalar | Annotated[list[Scalar], Field(max_length=MAX_LIST)]


class StrictModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


def is_local_model(ref: str) -> bool:
    return ref.startswith(("/", "./", "../", "~")) or ref in (".", "..")
