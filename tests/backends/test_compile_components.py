"""compile_components hands a recipe's torch.compile arguments to every way a component compiles
(`full`, `regional`, a method; b789298 had fixed `dynamic=False` for the first two). Traced by
Dynamo into a counting backend that runs the graph eagerly: no Inductor compile, no cache."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from diffusers import ModelMixin

from neffbuild.backends.recipe import compile_components
from neffbuild.documents.manifest import ModelEntry


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.linear(x) @ x.transpose(1, 2), -1) @ x


class Tiny(ModelMixin):  # diffusers' compile_repeated_blocks, as `regional` calls it
    _repeated_blocks = ("Block",)

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


class EagerBackend:
    """What compile_components asks of a backend; records whether each graph's sizes are symbols."""

    compiler_name = "eager"

    def __init__(self) -> None:
        self.graphs: list[bool] = []

    def compiler_for(self, recipe: Any) -> Any:
        def compile(gm: torch.fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
            values = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
            shapes = [v.shape for v in values if isinstance(v, torch.Tensor)]
            self.graphs.append(any(isinstance(size, torch.SymInt) for shape in shapes for size in shape))
            return gm.forward

        return compile


@pytest.mark.parametrize(
    ("mode", "component"), [("full", "transformer"), ("regional", "transformer"), ("full", "transformer.decode")]
)
@pytest.mark.parametrize("dynamic", [True, False])
def test_the_recipe_decides_whether_a_component_compiles_one_graph_for_many_sizes(
    mode: str, component: str, dynamic: bool
) -> None:
    torch._dynamo.reset()
    entry = ModelEntry.model_validate(
        {"id": "k", "model": "./m", "pipeline": "Flux2KleinPipeline", "shapes": {"height": 128, "width": 128},
         "mode": mode, "components": [component], "compile": {"dynamic": dynamic}}
    )  # fmt: skip
    pipe = types.SimpleNamespace(transformer=Tiny())
    backend = EagerBackend()
    compile_components(pipe, entry, backend)  # type: ignore[arg-type]
    call = pipe.transformer.decode if component.endswith(".decode") else pipe.transformer
    for tokens in (4, 6, 9):
        call(torch.randn(1, tokens, 8))
    # Dynamic: one graph for the three sizes, static: one per size (regional: per block too).
    blocks = 2 if mode == "regional" else 1
    assert len(backend.graphs) == blocks * (1 if dynamic else 3), backend.graphs
    assert all(backend.graphs) == dynamic
