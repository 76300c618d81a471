"""Manifest validation: every bad input is one clear message naming file, entry and key, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import tomllib

from neffbuild.errors import ManifestError
from tests.conftest import write_model_index
from neffbuild.manifest import load_manifest, manifest_json_schema

GOOD = """
name = "tiny"

[[model]]
id = "klein"
model = "./model"
pipeline = "Flux2KleinPipeline"
dtype = "float32"
mode = "full"
shapes = { height = 128, width = [128, 256], batch = [1, 2] }

[model.call]
num_inference_steps = 2

[model.env]
OMP_NUM_THREADS = "2"
"""


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """Just enough of a local diffusers model for validation: the index and a VAE config."""
    root = tmp_path / "model"
    (root / "vae").mkdir(parents=True)
    write_model_index(root)
    (root / "vae" / "config.json").write_text(json.dumps({"block_out_channels": [4, 4, 4, 4]}))
    return root


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "m.toml"
    path.write_text(text)
    return path


def test_good_manifest_expands_the_shape_product(tmp_path: Path, model_dir: Path) -> None:
    loaded = load_manifest(write(tmp_path, GOOD))
    (entry,) = loaded.manifest.models
    labels = [s.label for s in entry.expanded_shapes()]
    assert labels == ["128x128x1", "128x128x2", "128x256x1", "128x256x2"]
    assert loaded.resolve_model(entry) == str(model_dir)


BAD_CASES = {
    "unknown key gets a hint": (("mode = \"full\"", 'mdoe = "full"'), ["model[klein].mdoe", "did you mean 'mode'"]),
    "top-level typo": (('name = "tiny"', 'nmae = "tiny"'), ["nmae", "did you mean 'name'"]),
    "bad dtype": (('dtype = "float32"', 'dtype = "flaot32"'), ["model[klein].dtype", "flaot32"]),
    "missing pipeline": (('pipeline = "Flux2KleinPipeline"\n', ""), ["model[klein].pipeline", "required key is missing"]),
    "shape not a multiple of 16": (("height = 128", "height = 120"), ["model[klein].shapes.height", "120", "multiple of 16", "try 128"]),
    "duplicate shape": (("width = [128, 256]", "width = [128, 128]"), ["model[klein].shapes", "128x128x1", "twice"]),
    "zero batch": (("batch = [1, 2]", "batch = 0"), ["model[klein].shapes.batch", "greater than or equal to 1"]),
    "owned env var": (('OMP_NUM_THREADS = "2"', 'TORCHINDUCTOR_CACHE_DIR = "/x"'), ["model[klein].env", "TORCHINDUCTOR_CACHE_DIR", "set by neffbuild"]),
    "owned call arg": (("num_inference_steps = 2", "height = 64"), ["model[klein].call", "height"]),
    "device does not suit backend": (('mode = "full"', 'mode = "full"\ndevice = "neuron"'), ["model[klein]", "device 'neuron'", "inductor"]),
    "hub model without revision": (('model = "./model"', 'model = "org/flux"'), ["model[klein].revision", "org/flux"]),
    "local model without index": (('model = "./model"', 'model = "./nowhere"'), ["model[klein].model", "model_index.json"]),
    "bad mode": (('mode = "full"', 'mode = "fast"'), ["model[klein].mode", "fast"]),
    "tensor parallel on inductor": (('mode = "full"', 'mode = "full"\ntensor_parallel = 2'), ["model[klein]", "tensor_parallel", "neuron"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_manifest_is_one_clear_error_exit_2(case: str, tmp_path: Path, model_dir: Path, cli) -> None:
    (old, new), expected = BAD_CASES[case]
    assert old in GOOD
    path = write(tmp_path, GOOD.replace(old, new, 1))
    result = cli("plan", str(path))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert str(path) in result.stderr
    for fragment in expected:
        assert fragment in result.stderr, f"{fragment!r} not in {result.stderr!r}"
    assert "hint:" in result.stderr
    assert result.stdout == ""


def test_duplicate_entry_ids_are_rejected(tmp_path: Path, model_dir: Path) -> None:
    entry = GOOD.split("[[model]]", 1)[1]
    path = write(tmp_path, GOOD + "\n[[model]]" + entry)
    with pytest.raises(ManifestError, match=r"model\[klein\]\.id: duplicate entry id"):
        load_manifest(path)


def test_all_problems_are_reported_at_once(tmp_path: Path, model_dir: Path) -> None:
    text = GOOD.replace('dtype = "float32"', 'dtype = "f32"').replace('mode = "full"', 'mdoe = "full"')
    with pytest.raises(ManifestError) as err:
        load_manifest(write(tmp_path, text))
    assert "2 problems" in err.value.message
    assert "model[klein].dtype" in err.value.message and "model[klein].mdoe" in err.value.message


def test_toml_syntax_error_names_file_and_line(tmp_path: Path, cli) -> None:
    path = write(tmp_path, 'name = "x"\n[[model]\n')
    result = cli("plan", str(path))
    assert result.returncode == 2
    assert str(path) in result.stderr and "line 2" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_manifest_file(tmp_path: Path, cli) -> None:
    result = cli("plan", str(tmp_path / "absent.toml"))
    assert result.returncode == 2
    assert "absent.toml: no such manifest" in result.stderr


def test_debug_flag_shows_the_traceback(tmp_path: Path, model_dir: Path, cli) -> None:
    path = write(tmp_path, GOOD.replace('dtype = "float32"', 'dtype = "f32"'))
    result = cli("--debug", "plan", str(path))
    assert result.returncode == 2 and "Traceback" in result.stderr


def test_shipped_schema_is_current_and_accepts_the_repo_manifests(cli) -> None:
    root = Path(__file__).resolve().parent.parent
    shipped = json.loads((root / "neffbuild" / "schema" / "manifest.schema.json").read_text())
    assert shipped == manifest_json_schema(), "regenerate: neffbuild schema > neffbuild/schema/manifest.schema.json"
    printed = cli("schema")
    assert printed.returncode == 0 and json.loads(printed.stdout) == shipped
    for manifest in sorted((root / "manifests").glob("*.toml")):
        jsonschema.validate(tomllib.loads(manifest.read_text()), shipped)


def test_schema_rejects_what_the_loader_rejects() -> None:
    schema = manifest_json_schema()
    bad = {"name": "x", "model": [{"id": "a", "model": "./m", "pipeline": "P", "shapes": {"height": 1, "width": 1}, "mdoe": "full"}]}
    with pytest.raises(jsonschema.ValidationError, match="mdoe"):
        jsonschema.validate(bad, schema)
