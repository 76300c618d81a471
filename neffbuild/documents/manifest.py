"""Load a build manifest (TOML) into frozen, validated models.

Strict on purpose: a typo in a CI manifest must fail the build, not silently fall back to a
default and publish the wrong cache. Types are exact (no "128" or 128.0 for 128, no true for 1),
sizes and counts are bounded, and every problem names the file, the entry and the key.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator

from neffbuild import descriptors
from neffbuild.documents.compile_recipe import Recipe, ResolvedRecipe, resolve_recipe
from neffbuild.documents.manifest_messages import (
    IDENTIFIER,
    as_key,
    describe_validation,
    join_problems,
    short,
    validation_hint,
)
from neffbuild.documents.manifest_reading import read_json_object, read_toml, source_digest
from neffbuild.documents.manifest_types import (
    MAX_IMAGES,
    MAX_INT,
    MAX_LIST,
    MAX_NAME_PART,
    MAX_PATH,
    MAX_SIDE,
    MAX_TENSOR_PARALLEL,
    MAX_TEXT,
    MAX_UNITS,
    BackendName,
    Batch,
    CallValue,
    Device,
    Dtype,
    Mode,
    Side,
    StrictModel,
    is_local_model,
)
from neffbuild.errors import ManifestError

# Pipelines whose latent packing needs sizes divisible by vae_scale_factor * 2 (2x2 patches).
_PATCHED_PIPELINES = re.compile(r"^(Flux|Flux2|Flux2Klein|QwenImage|Chroma)\w*Pipeline$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_COMPONENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")
_S3_URL = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?$")
_CACHE_VARS_OWNED = {name for b in descriptors.BACKENDS for name in b.owned_env}
PROMPT_ARGS = re.compile(r"^(negative_)?prompt(_\d)?$")
DEFAULT_PROMPT = "a photo of a cat"  # the warmup prompt when a manifest's call gives none


class Shape(StrictModel):
    """One static shape: the pipeline is compiled for exactly this height, width and batch
    (batch fills the call's num_images_per_prompt)."""

    height: Side
    width: Side
    batch: Batch = 1

    @property
    def label(self) -> str:
        return f"{self.height}x{self.width}x{self.batch}"


class ShapeSet(StrictModel):
    """A product of heights × widths × batches; each field takes one value or a list."""

    height: Side | Annotated[list[Side], Field(min_length=1, max_length=MAX_LIST)]
    width: Side | Annotated[list[Side], Field(min_length=1, max_length=MAX_LIST)]
    batch: Batch | Annotated[list[Batch], Field(min_length=1, max_length=MAX_LIST)] = Field(
        default=1, description="num_images_per_prompt of the warmup call; images per call = batch x prompts."
    )

    def expand(self) -> list[Shape]:
        def as_list(v: int | list[int]) -> list[int]:
            return v if isinstance(v, list) else [v]

        return [
            Shape(height=h, width=w, batch=b)
            for h, w, b in itertools.product(as_list(self.height), as_list(self.width), as_list(self.batch))
        ]

    @property
    def size(self) -> int:
        return math.prod(len(v) if isinstance(v, list) else 1 for v in (self.height, self.width, self.batch))


def _default_device(data: dict[str, Any]) -> Device:
    backend = descriptors.find(data.get("backend", _DEFAULT_BACKEND)) or descriptors.portable()
    return backend.devices[0]


_DEFAULT_BACKEND = descriptors.portable().name
# "cpu for the inductor backend, neuron for neuron."
_DEVICE_DEFAULTS = ", ".join(
    f"{b.devices[0]} for {'the ' if i == 0 else ''}{b.name}{' backend' if i == 0 else ''}"
    for i, b in enumerate(descriptors.BACKENDS)
)


class ModelEntry(StrictModel):
    """One model to compile: where it comes from, how it is compiled and for which shapes."""

    id: str = Field(
        max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Entry name, unique in the manifest."
    )
    model: str = Field(
        min_length=1, max_length=MAX_PATH, description="Local directory (relative to the manifest) or hub id."
    )
    revision: str | None = Field(
        default=None,
        max_length=200,
        pattern=r"^[A-Za-z0-9._/-]+$",
        description="Hub revision; a commit sha keeps keys stable.",
    )
    pipeline: str = Field(
        max_length=200, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="diffusers pipeline class name."
    )
    dtype: Dtype = "bfloat16"
    backend: BackendName = _DEFAULT_BACKEND
    device: Device = Field(default_factory=_default_device, description=f"Default: {_DEVICE_DEFAULTS}.")
    mode: Mode = "full"
    components: Annotated[tuple[str, ...], Field(max_length=32)] = Field(
        default=("transformer",),
        description="Components to compile: a name ('transformer'), or a method of one ('vae.decode'), "
        "the callable the pipeline actually calls.",
    )
    tensor_parallel: Annotated[int, Strict()] = Field(
        default=1, ge=1, le=MAX_TENSOR_PARALLEL, description="Neuron only: processes per model (NeuronCores)."
    )
    shape_multiple: Annotated[int, Strict()] | None = Field(
        default=None, gt=0, le=MAX_SIDE, description="Override the pipeline's size divisor."
    )
    shapes: ShapeSet | Annotated[list[ShapeSet], Field(min_length=1, max_length=MAX_LIST)] = Field(
        description="One table or a list of tables; each expands to height x width x batch."
    )
    call: dict[str, CallValue] = Field(
        default_factory=dict, max_length=MAX_LIST, description="Extra pipeline call arguments."
    )
    env: dict[str, Annotated[str, Field(max_length=MAX_TEXT)]] = Field(
        default_factory=dict, max_length=MAX_LIST, description="Environment for build and serving."
    )
    compile: Recipe = Field(
        default_factory=Recipe,
        description="How the listed components are prepared and compiled ([model.compile]); default: "
        "torch.compile(fullgraph=True, dynamic=False) with the compiler's defaults.",
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not _ENV_NAME.match(name):
                raise ValueError(f"{short(name)} is not an environment variable name")
            if name in _CACHE_VARS_OWNED:
                raise ValueError(f"{name} is set by neffbuild per build unit; remove it")
        return env

    @field_validator("call", mode="before")
    @classmethod
    def _call_integers(cls, call: Any) -> Any:
        # Checked before the union: an integer too large for an int would pass as a float.
        for name, value in call.items() if isinstance(call, dict) else ():
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, int) and not isinstance(item, bool) and abs(item) > MAX_INT:
                    raise ValueError(f"{as_key(name)}: integer past 64 bits (got {short(item)})")
        return call

    @field_validator("call")
    @classmethod
    def _call_keys(cls, call: dict[str, Any]) -> dict[str, Any]:
        for name in call:
            if not IDENTIFIER.match(name):
                raise ValueError(f"{short(name)} is not a parameter name")
        owned = {"height", "width", "num_images_per_prompt", "generator", "output_type"}
        clash = sorted(owned & call.keys())
        if clash:
            raise ValueError(f"{', '.join(clash)} come from shapes or neffbuild itself; remove from call")
        for name, value in call.items():
            if PROMPT_ARGS.match(name) and not (
                isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value))
            ):
                raise ValueError(f"{name} must be a string or a non-empty list of strings")
        return call

    @field_validator("components")
    @classmethod
    def _component_names(cls, components: tuple[str, ...]) -> tuple[str, ...]:
        for name in components:
            if not _COMPONENT.match(name):
                raise ValueError(f"{short(name)} is not a component ('vae') or a component method ('vae.decode')")
        return components

    @model_validator(mode="after")
    def _consistent(self) -> ModelEntry:
        backend = descriptors.find(self.backend)
        assert backend is not None  # the literal let only a known name through
        if self.device not in backend.devices:
            allowed = ", ".join(backend.devices)
            raise ValueError(f"device {self.device!r} does not suit backend {self.backend!r} (use {allowed})")
        if self.tensor_parallel > 1 and not backend.tensor_parallel:
            sharding = " or ".join(repr(b.name) for b in descriptors.BACKENDS if b.tensor_parallel)
            raise ValueError(f"tensor_parallel > 1 needs backend = {sharding}")
        if self.mode == "eager" and self.components != ("transformer",):
            raise ValueError("components has no effect in mode 'eager'; remove it")
        if len(set(self.components)) != len(self.components) or not self.components:
            raise ValueError("components must be a non-empty list without duplicates")
        methods = [c for c in self.components if "." in c]
        if self.mode == "regional" and methods:
            raise ValueError(
                f"components: {methods[0]!r} names a method, but mode 'regional' compiles a component's repeated "
                f"blocks; list the component alone, use mode 'full', or add a second [[model]] entry (same model, "
                f"another id) with mode = 'full' and components = [{methods[0]!r}]"
            )
        if self.compile.artifact != "cache" and self.mode != "full":
            raise ValueError(
                f"compile.artifact {self.compile.artifact!r} exports whole components: it needs mode 'full' "
                f"(one package per repeated-block class is not built yet); use artifact = 'cache' for mode {self.mode!r}"
            )
        problem = self._call_size_problem() or self._recipe_problem()
        if problem:
            raise ValueError(problem)
        return self

    def _recipe_problem(self) -> str | None:
        if self.mode == "eager" and self.compile != Recipe():
            return "compile has no effect in mode 'eager' (nothing is compiled); remove it"
        unknown = sorted(set(self.compile.components) - set(self.components))
        if unknown:
            return (
                f"compile.components.{as_key(unknown[0])}: not a listed component "
                f"(components: {', '.join(self.components)})"
            )
        by_module: dict[str, tuple[str, ResolvedRecipe]] = {}
        for spec, (name, _method) in zip(self.components, self.components_named(), strict=True):
            resolved = self.recipe_for(spec)
            first = by_module.setdefault(name, (spec, resolved))
            if first[1].module_settings() != resolved.module_settings():
                return (
                    f"compile.components: {first[0]!r} and {spec!r} are one module ({name}) but ask for different "
                    "memory_format, fuse_qkv, attention_backend or quantize; make them agree"
                )
        return None

    def _call_size_problem(self) -> str | None:
        prompts = self.prompts_per_call
        # Every prompt-like list pairs with the prompts one by one (prompt_2 feeds the second
        # text encoder, negative_prompt the unconditional half): a pipeline zips them.
        for name, value in sorted(self.call.items()):
            if name != "prompt" and PROMPT_ARGS.match(name) and isinstance(value, list) and len(value) != prompts:
                given = f"{len(value)} {'entry' if len(value) == 1 else 'entries'}"
                return f"call.{name} has {given} for {prompts} prompt{'' if prompts == 1 else 's'}; give as many"
        sets = self.shapes if isinstance(self.shapes, list) else [self.shapes]
        if sum(s.size for s in sets) > MAX_UNITS:
            return f"shapes expand to more than {MAX_UNITS} units; split the entry"
        batch = max(max(s.batch) if isinstance(s.batch, list) else s.batch for s in sets)
        if batch * prompts > MAX_IMAGES:
            return f"batch {batch} x {prompts} prompts is {batch * prompts} images per call (at most {MAX_IMAGES})"
        return None

    @property
    def prompts_per_call(self) -> int:
        """A list of prompts multiplies the batch: the pipeline makes batch images per prompt."""
        prompt = self.call.get("prompt")
        return len(prompt) if isinstance(prompt, list) else 1

    def call_arguments(self) -> dict[str, Any]:
        """The warmup call's arguments from the manifest (shapes add height, width, batch)."""
        return {"prompt": DEFAULT_PROMPT, **self.call}

    def components_named(self) -> list[tuple[str, str | None]]:
        """(component, method or None) per listed component: 'vae.decode' -> ('vae', 'decode')."""
        return [(c.partition(".")[0], c.partition(".")[2] or None) for c in self.components]

    def recipe_for(self, spec: str) -> ResolvedRecipe:
        """The resolved recipe of one listed component ('transformer', 'vae.decode')."""
        return resolve_recipe(self.compile, spec)

    def recipe_document(self) -> dict[str, Any] | None:
        """What the key holds of the recipe: every component's resolved recipe, or None where
        the entry compiles with the defaults (so a manifest without a recipe keys as before)."""
        if self.mode == "eager":
            return None
        resolved = {spec: self.recipe_for(spec) for spec in self.components}
        if all(r == ResolvedRecipe() for r in resolved.values()):
            return None
        return {spec: r.as_dict() for spec, r in resolved.items()}

    def unit_label(self, shape: Shape) -> str:
        """height x width x images per call (batch x prompts): the batch the compiled graphs see."""
        return f"{shape.height}x{shape.width}x{shape.batch * self.prompts_per_call}"

    def expanded_shapes(self) -> list[Shape]:
        sets = self.shapes if isinstance(self.shapes, list) else [self.shapes]
        return [shape for shape_set in sets for shape in shape_set.expand()]


class Manifest(StrictModel):
    """A whole manifest file: its name is the default tag the build moves."""

    name: str = Field(max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="Default tag for the build.")
    description: str = Field(default="", max_length=MAX_TEXT)
    store: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_PATH,
        description="Default store: a directory (relative to the manifest) or s3://bucket/prefix.",
    )
    toolchain: dict[str, Annotated[str, Field(min_length=1, max_length=200)]] | None = Field(
        default=None,
        max_length=32,
        description="The build host's toolchain (versions, target), for planning on another host: "
        "e.g. neuron keys on a CI host without torch-neuronx.",
    )
    models: Annotated[list[ModelEntry], Field(min_length=1, max_length=MAX_LIST, alias="model")]

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @field_validator("store")
    @classmethod
    def _store_url(cls, store: str | None) -> str | None:
        if store is not None and "://" in store and not _S3_URL.match(store):
            scheme = store.split("://", 1)[0]
            if scheme == "s3":
                raise ValueError(f"{short(store)} is not s3://bucket[/prefix]")
            raise ValueError(f"unsupported scheme {short(scheme)} (use a directory path or s3://bucket/prefix)")
        return store

    @model_validator(mode="after")
    def _unit_count(self) -> Manifest:
        total = sum(len(e.expanded_shapes()) for e in self.models)
        if total > MAX_UNITS:
            raise ValueError(f"the entries expand to {total} units (at most {MAX_UNITS}); split the manifest")
        return self


class LoadedManifest(BaseModel):
    """A validated manifest plus where it came from. Paths resolve against its directory: the
    store is resolved when loading (manifest.store is absolute, URLs unchanged); local model
    paths by resolve_model."""

    model_config = ConfigDict(frozen=True)

    manifest: Manifest
    path: Path
    source_digest: str

    def resolve_model(self, entry: ModelEntry) -> str:
        """A local model path made absolute against the manifest's directory; hub ids unchanged."""
        if is_local_model(entry.model):
            return str((self.path.parent / Path(entry.model).expanduser()).resolve())
        return entry.model


def load_manifest(path: Path, *, text: str | None = None) -> LoadedManifest:
    """Parse and validate a manifest; raise ManifestError listing every problem found. With text:
    that content, judged as if it were at path (an edit checked before it replaces the file)."""
    data = read_toml(path, text)
    if isinstance(data.get("model"), dict):
        raise ManifestError(
            f"{path}: model: a single [model] table; models are an array of tables",
            hint="write [[model]] (two brackets) for each model, then [model.call] / [model.env] under it",
        )
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as exc:
        message, details = describe_validation(path, data, exc, Manifest)
        raise ManifestError(message, hint=validation_hint(exc), details=details) from None
    base = path.resolve().parent
    if manifest.store is not None and "://" not in manifest.store:
        manifest = manifest.model_copy(update={"store": str(base / Path(manifest.store).expanduser())})
    loaded = LoadedManifest(manifest=manifest, path=path.resolve(), source_digest=source_digest(data))
    problems = _cross_checks(loaded)
    if problems:
        message, details = join_problems(path, [p for p, _ in problems])
        raise ManifestError(
            message, hint=problems[0][1] if len(problems) == 1 else "fix the entries named above", details=details
        )
    return loaded


Problem = tuple[str, str]  # (message naming entry and key, hint)


def _cross_checks(loaded: LoadedManifest) -> list[Problem]:
    problems: list[Problem] = []
    seen_ids: set[str] = set()
    for entry in loaded.manifest.models:
        where = f"model[{entry.id}]"
        if entry.id in seen_ids:
            problems.append((f"{where}.id: duplicate entry id {entry.id!r}", "give every entry its own id"))
        seen_ids.add(entry.id)
        if is_local_model(entry.model):
            problem = _local_model_problem(loaded, entry)
            if problem:
                problems.append(problem)
                continue
        elif entry.revision is None:
            problems.append(
                (
                    f"{where}.revision: hub model {entry.model!r} needs a revision (a commit sha)",
                    'pin it: revision = "<sha>"',
                )
            )
        try:
            multiple = entry.shape_multiple or shape_multiple(entry, loaded)
        except ManifestError as exc:
            problems.append((f"{where}.model: {exc.message}", exc.hint or ""))
            continue
        problems.extend(_shape_problems(entry, multiple))
    return problems


def _local_model_problem(loaded: LoadedManifest, entry: ModelEntry) -> Problem | None:
    where = f"model[{entry.id}].model"
    if any(len(part.encode()) > MAX_NAME_PART for part in Path(entry.model).parts):
        return (
            f"{where}: a path component of {short(entry.model)} is longer than {MAX_NAME_PART} bytes",
            "check the path",
        )
    local = Path(loaded.resolve_model(entry))
    try:
        index_found = (local / "model_index.json").is_file()
    except OSError as exc:
        return (f"{where}: {short(entry.model)}: {exc.strerror or exc}", "check the path")
    if not index_found:
        return (
            f"{where}: {short(entry.model)} resolves to {short(str(local))}, which has no model_index.json",
            "a local model is a diffusers pipeline directory (save_pretrained); paths are relative to the manifest",
        )
    try:
        read_json_object(local / "model_index.json")
    except ManifestError as exc:
        return (f"{where}: {exc.message}", exc.hint or "")
    return None


def _shape_problems(entry: ModelEntry, multiple: int) -> list[Problem]:
    where = f"model[{entry.id}]"
    problems: list[Problem] = []
    seen_shapes: set[Shape] = set()
    for shape in entry.expanded_shapes():
        if shape in seen_shapes:
            problems.append((f"{where}.shapes: shape {shape.label} is listed twice", "list each shape once"))
        seen_shapes.add(shape)
        for side in ("height", "width"):
            value = getattr(shape, side)
            if value % multiple:
                problems.append(
                    (
                        f"{where}.shapes.{side}: {value} is not a multiple of {multiple} "
                        f"({entry.pipeline}); try {max(multiple, round(value / multiple) * multiple)}",
                        f"{entry.pipeline} needs sizes divisible by {multiple} (shape_multiple overrides it)",
                    )
                )
    return problems


def shape_multiple(entry: ModelEntry, loaded: LoadedManifest) -> int:
    """The divisor the pipeline needs: VAE scale factor, times 2 for 2x2-patching pipelines."""
    vae_factor = 8
    if is_local_model(entry.model):
        vae_config = Path(loaded.resolve_model(entry)) / "vae" / "config.json"
        if vae_config.exists():
            channels = read_json_object(vae_config).get("block_out_channels")
            if channels is not None:
                if not (isinstance(channels, list) and 1 <= len(channels) <= 8):
                    raise ManifestError(
                        f"{vae_config}: block_out_channels is not a list of 1 to 8 numbers",
                        hint="the model directory is damaged: save it again",
                    )
                vae_factor = 2 ** (len(channels) - 1)
    return vae_factor * 2 if _PATCHED_PIPELINES.match(entry.pipeline) else vae_factor


def manifest_json_schema() -> dict[str, Any]:
    """The JSON schema of a manifest, as shipped in neffbuild/schema/manifest.schema.json."""
    schema = Manifest.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "neffbuild manifest"
    return schema
