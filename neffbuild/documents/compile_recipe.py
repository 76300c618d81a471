"""[model.compile]: how each listed component is prepared and compiled, and the recipe resolved
with every default filled in (what a key holds and what a worker applies)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, field_validator, model_validator

from neffbuild.documents.manifest_messages import short
from neffbuild.documents.manifest_types import MAX_LIST, CallFloat, StrictModel, Text

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


class ComponentRecipe(StrictModel):
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
                raise ValueError(f"{short(name)} is not an Inductor setting name")
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
        )  # fmt: skip  # arguments packed by meaning, not one a line

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
