"""The backend descriptors: one per backend, what every stage reads of a backend it does not run,
and nothing outside backends/ and the registry that spells a backend's name itself."""

from __future__ import annotations

import ast
from pathlib import Path

from neffbuild import descriptors
from neffbuild.backends import get_backend
from neffbuild.documents.manifest import manifest_json_schema

ROOT = Path(__file__).resolve().parents[1]
# String constants equal to a backend's name that are something else: the recipe's `inductor`
# table (Inductor's settings) is a manifest field, not the backend. Counted, so a new one fails.
NOT_A_BACKEND = {"neffbuild/documents/compile_recipe.py": 2}


def test_each_descriptor_names_the_backend_that_implements_it() -> None:
    for described in descriptors.BACKENDS:
        backend = get_backend(described.name)
        assert type(backend).__name__ == described.implementation.rpartition(":")[2]
        assert backend.name == described.name and backend.cache_env == described.cache_env
        assert backend.default_device == described.devices[0]


def test_names_are_unique_and_exactly_one_backend_is_portable() -> None:
    assert len(set(descriptors.names())) == len(descriptors.BACKENDS)
    assert [b.name for b in descriptors.BACKENDS if b.portable] == [descriptors.portable().name]
    assert descriptors.by_specificity()[-1] is descriptors.portable()  # doctor looks for it last
    assert set(descriptors.by_specificity()) == set(descriptors.BACKENDS)


def test_the_manifest_schema_lists_the_registry_backends_and_devices() -> None:
    entry = manifest_json_schema()["$defs"]["ModelEntry"]["properties"]
    assert entry["backend"]["enum"] == list(descriptors.names())
    assert entry["backend"]["default"] == descriptors.portable().name
    assert entry["device"]["enum"] == list(descriptors.devices())
    assert len(set(descriptors.devices())) == len(descriptors.devices())


def backend_literals(package: Path, names: set[str]) -> dict[str, int]:
    """Per module outside backends/ and descriptors.py: how many string constants equal a backend's name."""
    found: dict[str, int] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        if rel.startswith("neffbuild/backends/") or rel == "neffbuild/descriptors.py":
            continue
        count = sum(
            isinstance(node, ast.Constant) and node.value in names for node in ast.walk(ast.parse(path.read_text()))
        )
        if count:
            found[rel] = count
    return found


def test_no_code_outside_the_backends_and_their_descriptors_spells_a_backend_name() -> None:
    assert backend_literals(ROOT / "neffbuild", set(descriptors.names())) == NOT_A_BACKEND


def test_the_literal_check_finds_a_planted_name(tmp_path: Path) -> None:
    (tmp_path / "neffbuild" / "build").mkdir(parents=True)
    (tmp_path / "neffbuild" / "backends").mkdir()
    (tmp_path / "neffbuild" / "build" / "rayfleet.py").write_text('if backend == "neuron":\n    cores = 1\n')
    (tmp_path / "neffbuild" / "backends" / "neuron.py").write_text('NAME = "neuron"\n')
    assert backend_literals(tmp_path / "neffbuild", {"neuron"}) == {"neffbuild/build/rayfleet.py": 1}
