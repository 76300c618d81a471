"""Every printed recipe is proven: for each combination of recipe fields the schema allows, what
`neffbuild.serve.prepare` compiles and what executing `neffbuild recipe`'s printed code compiles
are the same callables, traced to the same graphs, handed to Inductor with the same settings under
the same process settings. Dynamo traces for real; Inductor's compile_fx is replaced by a recorder
that runs the graph eagerly (no Inductor compile, no cache): seconds for the whole grid."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._inductor.compile_fx
import torch.fx.experimental._config as fx_config
from diffusers import ModelMixin

from neffbuild.backends.base import recompile_limit
from neffbuild.backends.recipecode import recipe_source
from neffbuild.documents.manifest import LoadedManifest, Manifest, ModelEntry
from neffbuild.serve import prepare

pytest.importorskip("torchao")  # the quantize extra: scripts/test.sh installs it


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.linear(x) @ x.transpose(1, 2), -1) @ x


class Tiny(ModelMixin):
    """What a recipe touches: repeated blocks (regional), a method (decode), a fusion and an
    attention backend that change the traced code, a convolution (channels_last changes its
    weight's strides), Linear layers of two sizes (quantize and its layer filter)."""

    _repeated_blocks = ("Block",)

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.proj_out = torch.nn.Linear(16, 16)
        self.small = torch.nn.Linear(16, 8)
        self.conv = torch.nn.Conv2d(2, 2, 1)
        self.fused = False
        self.attention = "native"

    def fuse_qkv_projections(self) -> None:
        self.fused = True

    def set_attention_backend(self, name: str) -> None:
        self.attention = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        if self.fused:
            x = x * 2
        if self.attention != "native":
            x = x + 1
        x = self.proj_out(x) + self.small(x).repeat(1, 1, 2)
        return self.conv(x.reshape(1, 2, x.shape[1], 8)).reshape(x.shape)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x) - 1


class TinyPipe:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.transformer = Tiny()

    def to(self, device: str) -> TinyPipe:
        return self

    def __call__(self, method: str | None, tokens: int) -> Any:
        call = self.transformer if method is None else getattr(self.transformer, method)
        with torch.no_grad():
            return call(torch.randn(1, tokens, 16))


# The grid: every way a component compiles x every mode x Inductor settings or none; per way,
# its eight cases also take every dynamic x module settings (all off, or all on: their
# combinations change no compile call) in turn, so each pair of fields meets (24 cases, ~1 min).
PATHS = {
    "full": ("full", "transformer"),
    "regional": ("regional", "transformer"),
    "method": ("full", "transformer.decode"),
}
MODES = ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
INDUCTOR: list[dict[str, Any]] = [{}, {"epilogue_fusion": False, "coordinate_descent_tuning": True}]
DYNAMIC: list[bool | str] = [False, True, "auto"]
MODULE_SETTINGS = {
    "plain": {},
    "all": {
        "fuse_qkv": True,
        "attention_backend": "_native_math",
        "memory_format": "channels_last",
        "quantize": "int8-dynamic",
        "quantize_skip": ["small"],
        "quantize_min_features": 16,
        "matmul_precision": "high",
    },
}
TURNS = list(itertools.product(DYNAMIC, MODULE_SETTINGS))
GRID = [
    (path, mode, inductor, *TURNS[i % len(TURNS)])
    for path in PATHS
    for i, (mode, inductor) in enumerate(itertools.product(MODES, range(len(INDUCTOR))))
]
# Issue 34's finding on its own: regional with a mode and Inductor settings printed `.compile(...)`.
GRID.append(("regional", "max-autotune", 1, False, "plain"))


def entry_of(path: str, mode: str, inductor: int, dynamic: bool | str, settings: str) -> ModelEntry:
    entry_mode, component = PATHS[path]
    recipe: dict[str, Any] = {"mode": mode, "inductor": INDUCTOR[inductor], "dynamic": dynamic}
    recipe.update(MODULE_SETTINGS[settings])
    if dynamic and settings == "all":
        recipe["duck_shape"] = False
    return ModelEntry.model_validate(
        {"id": "tiny", "model": "./m", "pipeline": "TinyPipe", "dtype": "float32", "mode": entry_mode,
         "components": [component], "shapes": {"height": 128, "width": [128, 256]}, "compile": recipe}
    )  # fmt: skip


def placeholder(node: torch.fx.Node) -> str:
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        return repr(value)
    return f"{type(value).__name__}{tuple(map(str, value.shape))}{tuple(map(str, value.stride()))}"


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, ...]]]:
    """What reaches Inductor, graph by graph; the process-wide settings restored after."""
    graphs: list[tuple[Any, ...]] = []

    def compile_fx(gm: torch.fx.GraphModule, inputs: Any, config_patches: Any = None, **kwargs: Any) -> Any:
        graphs.append(
            (
                gm.code,
                tuple(placeholder(n) for n in gm.graph.nodes if n.op == "placeholder"),
                tuple(sorted((config_patches or {}).items())),
                torch.get_float32_matmul_precision(),
                fx_config.use_duck_shape,
                torch._dynamo.config.specialize_float,
            )
        )
        return gm.forward

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", compile_fx)
    saved = (torch.get_float32_matmul_precision(), fx_config.use_duck_shape, torch._dynamo.config.specialize_float)
    saved_limits = (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit)
    yield graphs
    torch.set_float32_matmul_precision(saved[0])
    fx_config.use_duck_shape, torch._dynamo.config.specialize_float = saved[1], saved[2]
    torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit = saved_limits
    torch._dynamo.reset()


def serve(entry: ModelEntry, graphs: list[tuple[Any, ...]], apply: Any) -> tuple[list[tuple[Any, ...]], Any]:
    """A fresh pipeline, the recipe applied by `apply`, the listed shapes called in order."""
    torch._dynamo.reset()
    graphs.clear()
    pipe = TinyPipe()
    apply(pipe)
    method = entry.components_named()[0][1]
    outputs = [pipe(method, tokens) for tokens in (4, 6, 9)]
    return list(graphs), outputs


@pytest.mark.parametrize(("path", "mode", "inductor", "dynamic", "settings"), GRID)
def test_the_printed_recipe_compiles_what_prepare_compiles(
    recorded: list[tuple[Any, ...]], path: str, mode: str, inductor: int, dynamic: bool | str, settings: str
) -> None:
    entry = entry_of(path, mode, inductor, dynamic, settings)
    loaded = LoadedManifest(manifest=Manifest(name="t", model=[entry]), path="m.toml", source_digest="")
    prepared, prepared_out = serve(entry, recorded, lambda pipe: prepare(pipe, loaded, entry="tiny"))
    code = recipe_source(entry, "cpu", recompile_limit(len(entry.expanded_shapes())))
    printed, printed_out = serve(entry, recorded, lambda pipe: exec(code, {"pipe": pipe}))
    assert prepared, "prepare compiled nothing"
    assert printed == prepared, code
    for a, b in zip(printed_out, prepared_out, strict=True):
        assert torch.equal(a, b)
    # The grid really exercises what it names: regional compiles the block (both share its
    # graph), not the whole module; dynamic True symbolic graphs from the start, "auto" a static
    # graph then an automatic-dynamic one, False one static graph per size.
    assert all(("blocks_modules" in g[0]) == (path != "regional") for g in prepared)
    symbolic = [any(" 's" in p or "'s" in p for p in g[1]) for g in prepared]
    expected = {False: [False] * 3, True: [True], "auto": [False, True]}[dynamic]
    assert symbolic[: len(expected)] == expected, [g[1] for g in prepared]
    if settings == "all":
        assert "int8" in "".join(g[0] for g in prepared) or "quant" in "".join(g[0] for g in prepared)


# -- artifact 'package': the printed loader (run for real against a pulled release in test_artifacts.py)


def test_the_printed_package_loader_describes_inputs_as_prepare_dispatches_them() -> None:
    from neffbuild.backends.components import describe_input

    entry = entry_of("method", "default", 0, False, "plain").model_copy()
    package = ModelEntry.model_validate(
        {**entry.model_dump(exclude_none=True), "components": ["transformer", "transformer.decode"],
         "compile": {"artifact": "package"}}
    )  # fmt: skip
    code = recipe_source(package, "cpu", 8)
    assert "torch.compile(" not in code and ".compile(" not in code
    namespace: dict[str, Any] = {}
    exec(code.split("pipe = pipe.to")[0] + code[code.index("# artifact 'package'") :].split("\npipe.")[0], namespace)
    values = [
        torch.zeros(1, 64, 16), torch.zeros(2, dtype=torch.int64), None, True, 3, 0.5, "x", [1, (2.0, None)],
        {"b": torch.ones(1), 1: "a"}, torch.Generator(),
    ]  # fmt: skip
    assert [namespace["describe_input"](v) for v in values] == [describe_input(v) for v in values]
    assert (
        "Packages('aoti/transformer/" in code and "pipe.transformer.decode = Packages('aoti/transformer.decode/" in code
    )
