"""Load a build manifest (TOML) into frozen, validated models.

Strict on purpose: a typo in a CI manifest must fail the build, not silently fall back to a
default and publish the wrong cache. Every problem names the file, the entry and the key.
"""

from __future__ import annotations

import difflib
import itertools
import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from neffbuild.errors import ManifestError

Dtype = Literal["float32", "bfloat16", "float16"]
BackendName = Literal["inductor", "neuron"]
Mode = Literal["eager", "full", "regional"]
Scalar = str | int | float | bool
CallValue = Scalar | list[Scalar]

# Pipelines whose latent packing needs sizes divisible by vae_scale_factor * 2 (2x2 patches).
_PATCHED_PIPELINES = re.compile(r"^(Flux|Flux2|Flux2Klein|QwenImage|Chroma)\w*Pipeline$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_VALID_DEVICES = {"inductor": {"cpu", "cuda"}, "neuron": {"neuron"}}
_CACHE_VARS_OWNED = {"TORCHINDUCTOR_CACHE_DIR", "TORCH_NEURONX_NEFF_CACHE_DIR", "TRITON_CACHE_DIR"}


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


class Shape(_Strict):
    """One static shape: the pipeline is compiled for exactly this height, width and batch."""

    height: int = Field(gt=0)
    width: int = Field(gt=0)
    batch: int = Field(default=1, gt=0)

    @property
    def label(self) -> str:
        return f"{self.height}x{self.width}x{self.batch}"


class ShapeSet(_Strict):
    """A product of heights × widths × batches; each field takes one value or a list."""

    height: PositiveInt | Annotated[list[PositiveInt], Field(min_length=1)]
    width: PositiveInt | Annotated[list[PositiveInt], Field(min_length=1)]
    batch: PositiveInt | Annotated[list[PositiveInt], Field(min_length=1)] = 1

    def expand(self) -> list[Shape]:
        def as_list(v: int | list[int]) -> list[int]:
            return v if isinstance(v, list) else [v]

        return [
            Shape(height=h, width=w, batch=b)
            for h, w, b in itertools.product(as_list(self.height), as_list(self.width), as_list(self.batch))
        ]


class ModelEntry(_Strict):
    """One model to compile: where it comes from, how it is compiled and for which shapes."""

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Entry name, unique in the manifest.")
    model: str = Field(min_length=1, description="Local directory (relative to the manifest) or hub id.")
    revision: str | None = Field(default=None, description="Hub revision; a commit sha keeps keys stable.")
    pipeline: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="diffusers pipeline class name.")
    dtype: Dtype = "bfloat16"
    backend: BackendName = "inductor"
    device: str = "cpu"
    mode: Mode = "full"
    components: tuple[str, ...] = ("transformer",)
    tensor_parallel: int = Field(default=1, ge=1, description="Neuron only: processes per model (NeuronCores).")
    shape_multiple: int | None = Field(default=None, gt=0, description="Override the pipeline's size divisor.")
    shapes: ShapeSet | Annotated[list[ShapeSet], Field(min_length=1)] = Field(
        description="One table or a list of tables; each expands to height x width x batch."
    )
    call: dict[str, CallValue] = Field(default_factory=dict, description="Extra pipeline call arguments.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment for build and serving.")

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not _ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not an environment variable name")
            if name in _CACHE_VARS_OWNED:
                raise ValueError(f"{name} is set by neffbuild per build unit; remove it")
        return env

    @field_validator("call")
    @classmethod
    def _call_keys(cls, call: dict[str, CallValue]) -> dict[str, CallValue]:
        owned = {"height", "width", "num_images_per_prompt", "generator", "output_type"}
        clash = sorted(owned & call.keys())
        if clash:
            raise ValueError(f"{', '.join(clash)} come from shapes or neffbuild itself; remove from call")
        return call

    @model_validator(mode="after")
    def _consistent(self) -> ModelEntry:
        if self.device not in _VALID_DEVICES[self.backend]:
            allowed = ", ".join(sorted(_VALID_DEVICES[self.backend]))
            raise ValueError(f"device {self.device!r} does not suit backend {self.backend!r} (use {allowed})")
        if self.tensor_parallel > 1 and self.backend != "neuron":
            raise ValueError("tensor_parallel > 1 needs backend = 'neuron'")
        if self.mode == "eager" and self.components != ("transformer",):
            raise ValueError("components has no effect in mode 'eager'; remove it")
        if len(set(self.components)) != len(self.components) or not self.components:
            raise ValueError("components must be a non-empty list without duplicates")
        return self

    def expanded_shapes(self) -> list[Shape]:
        sets = self.shapes if isinstance(self.shapes, list) else [self.shapes]
        return [shape for shape_set in sets for shape in shape_set.expand()]


class Manifest(_Strict):
    """A whole manifest file: its name is the default tag the build moves."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Default tag for the build.")
    description: str = ""
    store: str | None = Field(default=None, description="Default store URL or directory.")
    models: Annotated[list[ModelEntry], Field(min_length=1, alias="model")]

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class LoadedManifest(BaseModel):
    """A validated manifest plus where it came from (paths resolve against its directory)."""

    model_config = ConfigDict(frozen=True)

    manifest: Manifest
    path: Path
    source_digest: str

    def resolve_model(self, entry: ModelEntry) -> str:
        """A local model path made absolute against the manifest's directory; hub ids unchanged."""
        if is_local_model(entry.model):
            return str((self.path.parent / entry.model).resolve())
        return entry.model


def is_local_model(ref: str) -> bool:
    return ref.startswith(("/", "./", "../", "~")) or ref in (".", "..")


def load_manifest(path: Path) -> LoadedManifest:
    """Parse and validate a manifest; raise ManifestError listing every problem found."""
    try:
        raw_bytes = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such manifest", hint="check the path, e.g. manifests/<name>.toml") from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read manifest ({exc.strerror})") from None
    try:
        data = tomllib.loads(raw_bytes.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: not valid TOML: {exc}", hint="see https://toml.io for the syntax") from None
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as exc:
        raise ManifestError(_describe(path, data, exc), hint=_hint(exc)) from None
    loaded = LoadedManifest(manifest=manifest, path=path.resolve(), source_digest=_digest(data))
    problems = _cross_checks(loaded)
    if problems:
        raise ManifestError(_join(path, problems), hint="fix the entries named above")
    return loaded


def _digest(data: dict[str, Any]) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(json.dumps(data, sort_keys=True, default=str).encode())


def _cross_checks(loaded: LoadedManifest) -> list[str]:
    problems: list[str] = []
    seen_ids: set[str] = set()
    for entry in loaded.manifest.models:
        where = f"model[{entry.id}]"
        if entry.id in seen_ids:
            problems.append(f"{where}.id: duplicate entry id {entry.id!r}")
        seen_ids.add(entry.id)
        if is_local_model(entry.model):
            local = Path(loaded.resolve_model(entry))
            if not (local / "model_index.json").is_file():
                problems.append(
                    f"{where}.model: {entry.model!r} resolves to {local}, which has no model_index.json"
                )
        elif entry.revision is None:
            problems.append(f"{where}.revision: hub model {entry.model!r} needs a revision (a commit sha)")
        multiple = entry.shape_multiple or shape_multiple(entry, loaded)
        seen_shapes: set[Shape] = set()
        for shape in entry.expanded_shapes():
            if shape in seen_shapes:
                problems.append(f"{where}.shapes: shape {shape.label} is listed twice")
            seen_shapes.add(shape)
            for side in ("height", "width"):
                value = getattr(shape, side)
                if value % multiple:
                    problems.append(
                        f"{where}.shapes.{side}: {value} is not a multiple of {multiple} "
                        f"({entry.pipeline}); try {max(multiple, round(value / multiple) * multiple)}"
                    )
    return problems


def shape_multiple(entry: ModelEntry, loaded: LoadedManifest) -> int:
    """The divisor the pipeline needs: VAE scale factor, times 2 for 2x2-patching pipelines."""
    vae_factor = 8
    if is_local_model(entry.model):
        vae_config = Path(loaded.resolve_model(entry)) / "vae" / "config.json"
        try:
            channels = json.loads(vae_config.read_text()).get("block_out_channels")
            if isinstance(channels, list) and channels:
                vae_factor = 2 ** (len(channels) - 1)
        except (OSError, ValueError):
            pass
    return vae_factor * 2 if _PATCHED_PIPELINES.match(entry.pipeline) else vae_factor


def _clean_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """Drop pydantic's union branch tags (`str`, `list[int]`, `ShapeSet`): not TOML keys."""
    tags = ("str", "int", "float", "bool", "ShapeSet")
    return tuple(p for p in loc if not (isinstance(p, str) and (p in tags or p.startswith(("list[", "constrained-")))))


def _describe(path: Path, data: dict[str, Any], exc: ValidationError) -> str:
    errors = [{**e, "loc": _clean_loc(e["loc"])} for e in exc.errors()]
    # A union reports every branch; where one branch got further, the others are noise.
    errors = [
        e for e in errors
        if not any(o is not e and len(o["loc"]) > len(e["loc"]) and o["loc"][: len(e["loc"])] == e["loc"] for o in errors)
    ]
    problems = []
    for err in errors:
        location = _location(data, err["loc"])
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown key" + _did_you_mean(err["loc"])
        elif err["type"] == "missing":
            message = "required key is missing"
        elif message.startswith("Value error, "):
            message = message.removeprefix("Value error, ")
        if err["type"] not in ("missing", "extra_forbidden") and "input" in err:
            message += f" (got {err['input']!r})"
        problems.append(f"{location}: {message}")
    return _join(path, problems)


def _join(path: Path, problems: list[str]) -> str:
    unique = list(dict.fromkeys(problems))
    if len(unique) == 1:
        return f"{path}: {unique[0]}"
    return f"{path}: {len(unique)} problems\n" + "\n".join(f"  {p}" for p in unique)


def _location(data: dict[str, Any], loc: tuple[int | str, ...]) -> str:
    """Render a pydantic location as TOML a user recognises: model[<id>].shapes.height."""
    parts: list[str] = []
    node: Any = data
    for part in loc:
        if isinstance(part, int):
            label = str(part)
            if isinstance(node, list) and part < len(node) and isinstance(node[part], dict):
                label = str(node[part].get("id", part))
            parts[-1] = f"{parts[-1]}[{label}]" if parts else f"[{label}]"
        else:
            parts.append(str(part))
        node = node[part] if isinstance(node, (dict, list)) and _has(node, part) else None
    return ".".join(parts) if parts else "(top level)"


def _has(node: dict[str, Any] | list[Any], part: int | str) -> bool:
    if isinstance(node, list):
        return isinstance(part, int) and part < len(node)
    return part in node


def _did_you_mean(loc: tuple[int | str, ...]) -> str:
    owner: type[BaseModel] = Manifest
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = owner.model_fields.get(part) or next(
            (f for f in owner.model_fields.values() if f.alias == part), None
        )
        inner = _model_in(field.annotation) if field else None
        if inner is None:
            return ""
        owner = inner
    names = [f.alias or n for n, f in owner.model_fields.items()]
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; expected one of {', '.join(sorted(names))}"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or getattr(annotation, "__metadata__", ()):
        found = _model_in(arg)
        if found:
            return found
    origin = getattr(annotation, "__origin__", None)
    return _model_in(origin) if origin not in (None, list, dict, tuple) else None


def _hint(exc: ValidationError) -> str:
    if any(e["type"] == "extra_forbidden" for e in exc.errors()):
        return "unknown keys are rejected so a typo cannot silently change a build; `neffbuild schema` prints every key"
    return "`neffbuild schema` prints every key with its type"


def manifest_json_schema() -> dict[str, Any]:
    """The JSON schema of a manifest, as shipped in neffbuild/schema/manifest.schema.json."""
    schema = Manifest.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "neffbuild manifest"
    return schema
