"""Load a build manifest (TOML) into frozen, validated models.

Strict on purpose: a typo in a CI manifest must fail the build, not silently fall back to a
default and publish the wrong cache. Types are exact (no "128" or 128.0 for 128, no true for 1),
sizes and counts are bounded, and every problem names the file, the entry and the key.
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator

from neffbuild import descriptors
from neffbuild.errors import ManifestError

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

# Pipelines whose latent packing needs sizes divisible by vae_scale_factor * 2 (2x2 patches).
_PATCHED_PIPELINES = re.compile(r"^(Flux|Flux2|Flux2Klein|QwenImage|Chroma)\w*Pipeline$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_COMPONENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")
_S3_URL = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?$")
_CACHE_VARS_OWNED = {name for b in descriptors.BACKENDS for name in b.owned_env}
PROMPT_ARGS = re.compile(r"^(negative_)?prompt(_\d)?$")
DEFAULT_PROMPT = "a photo of a cat"  # the warmup prompt when a manifest's call gives none


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)


class Shape(_Strict):
    """One static shape: the pipeline is compiled for exactly this height, width and batch
    (batch fills the call's num_images_per_prompt)."""

    height: Side
    width: Side
    batch: Batch = 1

    @property
    def label(self) -> str:
        return f"{self.height}x{self.width}x{self.batch}"


class ShapeSet(_Strict):
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


CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
MemoryFormat = Literal["contiguous", "channels_last"]
MatmulPrecision = Literal["highest", "high", "medium"]
# What a build ships per listed component: the compiler's cache (a server still traces), or an
# AOTInductor package per input signature (a server loads it: no tracing, no compile).
ArtifactKind = Literal["cache", "package"]
# torchao: int8 dynamic activation + int8 weight; float8 the same in float8 (CUDA only).
Quantization = Literal["int8-dynamic", "float8-dynamic"]
SkipPatterns = Annotated[tuple[Annotated[str, Field(min_length=1, max_length=200)], ...], Field(max_length=64)]
Dynamic = Annotated[bool, Strict()] | Literal["auto"]  # "auto": torch.compile's dynamic=None (automatic dynamic shapes)
InductorValue = Annotated[bool, Strict()] | Annotated[int, Strict()] | CallFloat | Text
_SETTING = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_BACKEND_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class ComponentRecipe(_Strict):
    """How one listed component is prepared and compiled; unset fields take the entry's [model.compile]."""

    mode: CompileMode | None = Field(default=None, description="torch.compile mode (inductor only).")
    inductor: dict[str, InductorValue] = Field(
        default_factory=dict,
        max_length=MAX_LIST,
        description="torch._inductor.config settings, checked against the installed torch at plan.",
    )
    memory_format: MemoryFormat | None = Field(
        default=None, description="module.to(memory_format=...) before compiling."
    )
    fuse_qkv: bool | None = Field(default=None, description="module.fuse_qkv_projections() before compiling.")
    attention_backend: str | None = Field(
        default=None,
        max_length=100,
        pattern=_BACKEND_NAME,
        description="module.set_attention_backend(...) (diffusers).",
    )
    quantize: Quantization | None = Field(
        default=None,
        description="torchao quantize_ before compiling: 'int8-dynamic', 'float8-dynamic' (CUDA); needs torchao.",
    )
    quantize_skip: SkipPatterns | None = Field(
        default=None,
        description="With quantize: Linear layers left unquantized, by name pattern (fnmatch on the "
        "module's qualified name, e.g. 'proj_out' or 'single_transformer_blocks.*.proj_mlp').",
    )
    quantize_min_features: Annotated[int, Strict()] | None = Field(
        default=None,
        ge=1,
        le=1 << 20,
        description="With quantize: Linear layers with fewer input or output features are left unquantized.",
    )

    @field_validator("inductor")
    @classmethod
    def _setting_names(cls, settings: dict[str, Any]) -> dict[str, Any]:
        for name in settings:
            if not _SETTING.match(name):
                raise ValueError(f"{_short(name)} is not an Inductor setting name")
        return settings


class Recipe(ComponentRecipe):
    """[model.compile]: the recipe of every listed component, with per-component overrides, and
    the settings one compile of the whole pipeline shares (dynamic shapes, matmul precision)."""

    dynamic: Dynamic = Field(
        default=False,
        description="torch.compile(dynamic=...): true, one graph for many sizes; 'auto', torch's default "
        "(dynamic=None: the first shape static, then an automatic-dynamic graph); false, one graph per shape.",
    )
    duck_shape: bool = Field(
        default=True,
        description="With dynamic: torch.fx.experimental._config.use_duck_shape (false: equal sizes get their own symbols).",
    )
    matmul_precision: MatmulPrecision | None = Field(
        default=None, description="torch.set_float32_matmul_precision during compile and calls."
    )
    artifact: ArtifactKind = Field(
        default="cache",
        description="What the build ships: 'cache', the compiler's cache (a server traces and loads); "
        "'package', an AOTInductor package per listed component and input signature (a server loads it "
        "without tracing or compiling; static shapes, inductor only).",
    )
    components: dict[str, ComponentRecipe] = Field(
        default_factory=dict, max_length=32, description="Overrides per listed component ('transformer', 'vae.decode')."
    )

    @model_validator(mode="after")
    def _duck_needs_dynamic(self) -> Recipe:
        if not self.duck_shape and not self.dynamic:
            raise ValueError("duck_shape = false has no effect without dynamic = true; remove it or set dynamic")
        if self.artifact != "cache" and self.dynamic:
            raise ValueError("artifact = 'package' exports one static graph per shape; remove dynamic")
        for where, recipe in [("", self), *((f"components.{k}.", v) for k, v in self.components.items())]:
            filters = recipe.quantize_skip is not None or recipe.quantize_min_features is not None
            if filters and recipe.quantize is None and self.quantize is None:
                raise ValueError(f"{where}quantize_skip / quantize_min_features have no effect without quantize")
        return self


@dataclass(frozen=True)
class ResolvedRecipe:
    """One component's recipe with every default filled in: what the key holds and what is applied."""

    mode: str = "default"
    inductor: Mapping[str, Any] = field(default_factory=dict)
    memory_format: str = "contiguous"
    fuse_qkv: bool = False
    attention_backend: str | None = None
    quantize: str | None = None
    dynamic: bool | str = False  # True, False or "auto" (torch.compile's dynamic=None)
    duck_shape: bool = True
    matmul_precision: str | None = None
    quantize_skip: tuple[str, ...] = ()
    quantize_min_features: int | None = None
    artifact: str = "cache"

    @property
    def compile_dynamic(self) -> bool | None:
        """torch.compile's dynamic argument: "auto" is its default, None."""
        return None if self.dynamic == "auto" else bool(self.dynamic)

    def module_settings(self) -> tuple[Any, ...]:
        """What changes the module itself (not the compile): two methods of one module must agree."""
        return (
            self.memory_format, self.fuse_qkv, self.attention_backend, self.quantize,
            self.quantize_skip, self.quantize_min_features,
        )  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        document = {**asdict(self), "inductor": dict(sorted(self.inductor.items()))}
        # Fields added later are keyed only when set: recipes without them key as before.
        document["quantize_skip"] = list(self.quantize_skip)
        for name in _LATER_FIELDS:
            if not document[name]:
                del document[name]
        if document["artifact"] == "cache":  # the default keys as before artifacts existed
            del document["artifact"]
        return document


_LATER_FIELDS = ("quantize_skip", "quantize_min_features")


def resolve_recipe(recipe: Recipe, spec: str) -> ResolvedRecipe:
    """The entry's recipe for one component: its override's fields over the entry's, over defaults."""
    override = recipe.components.get(spec, ComponentRecipe())
    default = ResolvedRecipe()

    def pick(name: str) -> Any:
        value = getattr(override, name)
        value = getattr(recipe, name) if value is None else value
        return getattr(default, name) if value is None else value

    return ResolvedRecipe(
        mode=pick("mode"),
        inductor={**recipe.inductor, **override.inductor},
        memory_format=pick("memory_format"),
        fuse_qkv=pick("fuse_qkv"),
        attention_backend=pick("attention_backend"),
        quantize=pick("quantize"),
        quantize_skip=tuple(pick("quantize_skip")),
        quantize_min_features=pick("quantize_min_features"),
        dynamic=recipe.dynamic,
        duck_shape=recipe.duck_shape,
        matmul_precision=recipe.matmul_precision,
        artifact=recipe.artifact,
    )


def _default_device(data: dict[str, Any]) -> Device:
    backend = descriptors.find(data.get("backend", _DEFAULT_BACKEND)) or descriptors.portable()
    return backend.devices[0]


_DEFAULT_BACKEND = descriptors.portable().name
# "cpu for the inductor backend, neuron for neuron."
_DEVICE_DEFAULTS = ", ".join(
    f"{b.devices[0]} for {'the ' if i == 0 else ''}{b.name}{' backend' if i == 0 else ''}"
    for i, b in enumerate(descriptors.BACKENDS)
)


class ModelEntry(_Strict):
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
                raise ValueError(f"{_short(name)} is not an environment variable name")
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
                    raise ValueError(f"{_key(name)}: integer past 64 bits (got {_short(item)})")
        return call

    @field_validator("call")
    @classmethod
    def _call_keys(cls, call: dict[str, Any]) -> dict[str, Any]:
        for name in call:
            if not _IDENTIFIER.match(name):
                raise ValueError(f"{_short(name)} is not a parameter name")
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
                raise ValueError(f"{_short(name)} is not a component ('vae') or a component method ('vae.decode')")
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
                f"compile.components.{_key(unknown[0])}: not a listed component "
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


class Manifest(_Strict):
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
                raise ValueError(f"{_short(store)} is not s3://bucket[/prefix]")
            raise ValueError(f"unsupported scheme {_short(scheme)} (use a directory path or s3://bucket/prefix)")
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


def is_local_model(ref: str) -> bool:
    return ref.startswith(("/", "./", "../", "~")) or ref in (".", "..")


def load_manifest(path: Path, *, text: str | None = None) -> LoadedManifest:
    """Parse and validate a manifest; raise ManifestError listing every problem found. With text:
    that content, judged as if it were at path (an edit checked before it replaces the file)."""
    data = _read_toml(path, text)
    if isinstance(data.get("model"), dict):
        raise ManifestError(
            f"{path}: model: a single [model] table; models are an array of tables",
            hint="write [[model]] (two brackets) for each model, then [model.call] / [model.env] under it",
        )
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as exc:
        message, details = _describe(path, data, exc)
        raise ManifestError(message, hint=_hint(exc), details=details) from None
    base = path.resolve().parent
    if manifest.store is not None and "://" not in manifest.store:
        manifest = manifest.model_copy(update={"store": str(base / Path(manifest.store).expanduser())})
    loaded = LoadedManifest(manifest=manifest, path=path.resolve(), source_digest=_digest(data))
    problems = _cross_checks(loaded)
    if problems:
        message, details = join_problems(path, [p for p, _ in problems])
        raise ManifestError(
            message, hint=problems[0][1] if len(problems) == 1 else "fix the entries named above", details=details
        )
    return loaded


def _read_toml(path: Path, text: str | None = None) -> dict[str, Any]:
    try:
        raw_bytes = path.read_bytes() if text is None else text.encode("utf-8", "surrogatepass")
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such manifest", hint="check the path, e.g. manifests/<name>.toml") from None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read manifest ({exc.strerror or exc})") from None
    try:
        data = tomllib.loads(raw_bytes.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: not valid TOML: {exc}", hint="see https://toml.io for the syntax") from None
    except RecursionError:
        data = None
    problem = _shape_problem(data)
    if problem:
        raise ManifestError(f"{path}: {problem}", hint=f"a manifest nests at most {MAX_DEPTH} levels and holds no NUL")
    assert data is not None
    return data


def _shape_problem(data: Any) -> str | None:
    """Depth and NUL check over the parsed document, without recursion (it may be hostile)."""
    if data is None:
        return f"nested deeper than {MAX_DEPTH} levels"
    stack: list[tuple[Any, tuple[int | str, ...]]] = [(data, ())]
    while stack:
        node, loc = stack.pop()
        if len(loc) > MAX_DEPTH:
            return f"{_location(data, loc[:MAX_DEPTH])}: nested deeper than {MAX_DEPTH} levels"
        items: list[tuple[int | str, Any]] = []
        if isinstance(node, dict):
            items = list(node.items())
        elif isinstance(node, list):
            items = list(enumerate(node))
        for key, value in items:
            if (isinstance(key, str) and "\0" in key) or (isinstance(value, str) and "\0" in value):
                return f"{_location(data, (*loc, key))}: contains a NUL character"
            if isinstance(value, (dict, list)):
                stack.append((value, (*loc, key)))
    return None


def _digest(data: dict[str, Any]) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(json.dumps(data, sort_keys=True, default=str).encode())


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
            f"{where}: a path component of {_short(entry.model)} is longer than {MAX_NAME_PART} bytes",
            "check the path",
        )
    local = Path(loaded.resolve_model(entry))
    try:
        index_found = (local / "model_index.json").is_file()
    except OSError as exc:
        return (f"{where}: {_short(entry.model)}: {exc.strerror or exc}", "check the path")
    if not index_found:
        return (
            f"{where}: {_short(entry.model)} resolves to {_short(str(local))}, which has no model_index.json",
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


def read_json_object(path: Path) -> dict[str, Any]:
    """A model's JSON config, which must be an object; ManifestError naming the file otherwise."""
    try:
        data = json.loads(path.read_bytes())
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read ({exc.strerror or exc})", hint="check the model directory") from None
    except (ValueError, RecursionError) as exc:
        reason = str(exc).splitlines()[0][:120] if not isinstance(exc, RecursionError) else "nested too deeply"
        raise ManifestError(
            f"{path}: not valid JSON ({reason})", hint="the model directory is damaged: save it again"
        ) from None
    if not isinstance(data, dict):
        raise ManifestError(
            f"{path}: not a JSON object (found {type(data).__name__})",
            hint="the model directory is damaged: save it again",
        )
    return data


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


def _clean_loc(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """Drop pydantic's union branch tags (`str`, `list[int]`, `ShapeSet`): not TOML keys."""
    tags = ("str", "int", "float", "bool", "ShapeSet")
    return tuple(
        p
        for p in loc
        if not (isinstance(p, str) and (p in tags or p.startswith(("list[", "constrained-", "function-"))))
    )


def _describe(path: Path, data: dict[str, Any], exc: ValidationError) -> tuple[str, tuple[str, ...]]:
    # A default computed from another field (device from backend) says nothing of its own.
    errors: list[dict[str, Any]] = [
        {**e, "loc": _clean_loc(e["loc"])} for e in exc.errors() if e["type"] != "default_factory_not_called"
    ]
    # A union reports every branch; where one branch got further, the others are noise.
    errors = [
        e
        for e in errors
        if not any(
            o is not e and len(o["loc"]) > len(e["loc"]) and o["loc"][: len(e["loc"])] == e["loc"] for o in errors
        )
    ]
    problems = []
    for err in _merge_union_branches(errors):
        location = _location(data, err["loc"])
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown key" + _did_you_mean(err["loc"])
        elif err["type"] == "missing":
            message = "required key is missing"
        elif message.startswith("Value error, "):
            message = message.removeprefix("Value error, ")
        if err["type"] not in ("missing", "extra_forbidden") and "input" in err and _is_scalar(err["input"]):
            message += f" (got {_short(err['input'])})"
        problems.append(f"{location}: {message}")
    return join_problems(path, problems)


def _merge_union_branches(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`height = 0` fails both branches of "a number or a list": report the bound, not "not a
    list"; `height = "128"` fails both on type: one message naming both accepted types."""
    by_loc: dict[tuple[int | str, ...], list[dict[str, Any]]] = {}
    for err in errors:
        by_loc.setdefault(err["loc"], []).append(err)
    merged = []
    for group in by_loc.values():
        kept = [e for e in group if not e["type"].endswith("_type")] or group
        if len(kept) > 1 and all(e["type"].endswith("_type") for e in kept):
            rest = [e["msg"].removeprefix("Input should be ") for e in kept[1:]]
            kept = [{**kept[0], "msg": ", or ".join([kept[0]["msg"], *rest])}]
        merged.extend(kept)
    return merged


def _key(name: str) -> str:
    """A key as written where it is a plain name, quoted and cut short otherwise."""
    return name if _IDENTIFIER.match(name) and len(name) <= 60 else _short(name)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool))


def _short(value: Any, limit: int = 60) -> str:
    """A value as a user typed it, cut short: never a whole entry dumped as a Python dict."""
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return f"an array of {len(value)}"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "…" + text[-3:]


def join_problems(path: Path, problems: list[str]) -> tuple[str, tuple[str, ...]]:
    """A file's problems as a message and the lines under it: the one problem on the message's
    line, or a count there and each problem (once) on a line of its own. The message stays one
    line: the terminal sanitiser would show a newline inside it as an escape."""
    unique = list(dict.fromkeys(problems))
    if len(unique) == 1:
        return f"{path}: {unique[0]}", ()
    return f"{path}: {len(unique)} problems", tuple(f"  {p}" for p in unique)


def _location(data: dict[str, Any], loc: tuple[int | str, ...]) -> str:
    """Render a pydantic location as TOML a user recognises: model[<id>].shapes.height."""
    parts: list[str] = []
    node: Any = data
    for part in loc:
        if isinstance(part, int):
            label = str(part)
            if isinstance(node, list) and part < len(node) and isinstance(node[part], dict):
                entry_id = node[part].get("id", part)
                label = entry_id if isinstance(entry_id, str) and _ENTRY_ID.match(entry_id) else str(part)
            parts[-1] = f"{parts[-1]}[{label}]" if parts else f"[{label}]"
        else:
            parts.append(str(part) if _ENTRY_KEY.match(str(part)) else _short(str(part), 40))
        node = node[part] if isinstance(node, (dict, list)) and _has(node, part) else None  # type: ignore[index]  # _has: an int for a list
    return ".".join(parts) if parts else "(top level)"


_ENTRY_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_ENTRY_KEY = re.compile(r"^[A-Za-z0-9_-]{1,60}$")


def _has(node: dict[str, Any] | list[Any], part: int | str) -> bool:
    if isinstance(node, list):
        return isinstance(part, int) and part < len(node)
    return part in node


def _did_you_mean(loc: tuple[int | str, ...]) -> str:
    owner: type[BaseModel] = Manifest
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = owner.model_fields.get(part) or next((f for f in owner.model_fields.values() if f.alias == part), None)
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
    if any(e["type"].endswith("_type") and isinstance(e.get("input"), (str, float, bool)) for e in exc.errors()):
        return 'types are exact: write 128, not "128" or 128.0, and true/false only where a switch is expected'
    return "`neffbuild schema` prints every key with its type and limits"


def manifest_json_schema() -> dict[str, Any]:
    """The JSON schema of a manifest, as shipped in neffbuild/schema/manifest.schema.json."""
    schema = Manifest.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "neffbuild manifest"
    return schema
