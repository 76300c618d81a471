"""Manifest validation: every bad input is one clear message naming file, entry and key, exit 2."""

from __future__ import annotations

import datetime
import json
import tomllib
from pathlib import Path

import jsonschema
import pytest

from neffbuild.documents.manifest import load_manifest, manifest_json_schema
from neffbuild.errors import ManifestError
from tests.conftest import write_model_index

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
    "unknown key gets a hint": (('mode = "full"', 'mdoe = "full"'), ["model[klein].mdoe", "did you mean 'mode'"]),
    "top-level typo": (('name = "tiny"', 'nmae = "tiny"'), ["nmae", "did you mean 'name'"]),
    "bad dtype": (('dtype = "float32"', 'dtype = "flaot32"'), ["model[klein].dtype", "flaot32"]),
    "missing pipeline": (
        ('pipeline = "Flux2KleinPipeline"\n', ""),
        ["model[klein].pipeline", "required key is missing"],
    ),
    "shape not a multiple of 16": (
        ("height = 128", "height = 120"),
        ["model[klein].shapes.height", "120", "multiple of 16", "try 128"],
    ),
    "duplicate shape": (("width = [128, 256]", "width = [128, 128]"), ["model[klein].shapes", "128x128x1", "twice"]),
    "zero batch": (("batch = [1, 2]", "batch = 0"), ["model[klein].shapes.batch", "greater than or equal to 1"]),
    "owned env var": (
        ('OMP_NUM_THREADS = "2"', 'TORCHINDUCTOR_CACHE_DIR = "/x"'),
        ["model[klein].env", "TORCHINDUCTOR_CACHE_DIR", "set by neffbuild"],
    ),
    "owned call arg": (("num_inference_steps = 2", "height = 64"), ["model[klein].call", "height"]),
    "device does not suit backend": (
        ('mode = "full"', 'mode = "full"\ndevice = "neuron"'),
        ["model[klein]", "device 'neuron'", "inductor"],
    ),
    "hub model without revision": (('model = "./model"', 'model = "org/flux"'), ["model[klein].revision", "org/flux"]),
    "local model without index": (
        ('model = "./model"', 'model = "./nowhere"'),
        ["model[klein].model", "model_index.json"],
    ),
    "bad mode": (('mode = "full"', 'mode = "fast"'), ["model[klein].mode", "fast"]),
    "tensor parallel on inductor": (
        ('mode = "full"', 'mode = "full"\ntensor_parallel = 2'),
        ["model[klein]", "tensor_parallel", "neuron"],
    ),
    # Types are exact: no coercion from strings, floats or booleans.
    "height as a string": (
        ("height = 128", 'height = "128"'),
        ["model[klein].shapes.height", "valid integer", "'128'", "types are exact"],
    ),
    "height as a float": (("height = 128", "height = 128.0"), ["model[klein].shapes.height", "valid integer", "128.0"]),
    "batch as a boolean": (("batch = [1, 2]", "batch = true"), ["model[klein].shapes.batch", "valid integer", "True"]),
    "tensor_parallel as a float": (
        ('mode = "full"', 'mode = "full"\ntensor_parallel = 1.0'),
        ["model[klein].tensor_parallel", "valid integer"],
    ),
    "env value as a number": (
        ('OMP_NUM_THREADS = "2"', "OMP_NUM_THREADS = 2"),
        ["model[klein].env.OMP_NUM_THREADS", "valid string"],
    ),
    # Bounds.
    "height past the limit": (
        ("height = 128", "height = " + "1" + "0" * 40),
        ["model[klein].shapes.height", "less than or equal to 16384"],
    ),
    "batch past the limit": (
        ("batch = [1, 2]", "batch = 1000"),
        ["model[klein].shapes.batch", "less than or equal to 256"],
    ),
    "prompts times batch past the limit": (
        ("num_inference_steps = 2", "prompt = [" + ", ".join(['"a"'] * 200) + "]"),
        ["batch 2 x 200 prompts is 400 images per call"],
    ),
    "too many units": (
        (
            "height = 128, width = [128, 256]",
            "height = [128, 256, 384], width = [" + ", ".join(str(16 * i) for i in range(1, 257)) + "]",
        ),
        ["more than 1024 units"],
    ),
    "a call integer past 64 bits": (
        ("num_inference_steps = 2", "num_inference_steps = " + "9" * 30),
        ["model[klein].call", "num_inference_steps: integer past 64 bits"],
    ),
    "a call float that is not finite": (
        ("num_inference_steps = 2", "guidance_scale = nan"),
        ["model[klein].call.guidance_scale", "finite"],
    ),
    "a call argument that is no name": (
        ("num_inference_steps = 2", '"steps-2" = 2'),
        ["model[klein].call", "'steps-2' is not a parameter name"],
    ),
    "a prompt that is no text": (
        ("num_inference_steps = 2", "prompt = 3"),
        ["model[klein].call", "prompt must be a string"],
    ),
    # Store URLs, NUL, paths.
    "store with another scheme": (
        ('name = "tiny"', 'name = "tiny"\nstore = "ftp://b/p"'),
        ["store", "unsupported scheme 'ftp'"],
    ),
    "store that is no s3 url": (
        ('name = "tiny"', 'name = "tiny"\nstore = "s3://"'),
        ["store", "is not s3://bucket[/prefix]"],
    ),
    "NUL in an env value": (
        ('OMP_NUM_THREADS = "2"', 'OMP_NUM_THREADS = "2\\u0000"'),
        ["model[klein].env.OMP_NUM_THREADS", "NUL"],
    ),
    "NUL in the model path": (('model = "./model"', 'model = "./mo\\u0000del"'), ["model[klein].model", "NUL"]),
    "NUL in a call string": (("num_inference_steps = 2", 'prompt = "a\\u0000b"'), ["model[klein].call.prompt", "NUL"]),
    "NUL in a key": (("num_inference_steps = 2", '"a\\u0000b" = 1'), ["model[klein].call", "NUL"]),
    "over-long model path": (
        ('model = "./model"', 'model = "./' + "a" * 5000 + '"'),
        ["model[klein].model", "at most 4096 characters"],
    ),
    "over-long path component": (
        ('model = "./model"', 'model = "./' + "a" * 300 + '"'),
        ["model[klein].model", "longer than 255 bytes"],
    ),
    # Shapes of the document itself.
    "[model] instead of [[model]]": (
        ("[[model]]", "[model]"),
        ["model: a single [model] table", "[[model]] (two brackets)"],
    ),
    "deeply nested value": (("num_inference_steps = 2", "x = " + "[" * 40 + "]" * 40), ["nested deeper than 8 levels"]),
    "nesting past the parser's recursion": (
        ("num_inference_steps = 2", "x = " + "[" * 5000 + "]" * 5000),
        ["nested deeper than 8 levels"],
    ),
    # Components.
    "a method in regional mode": (
        ('mode = "full"', 'mode = "regional"\ncomponents = ["vae.decode"]'),
        ["'vae.decode' names a method", "mode 'full'"],
    ),
    "a component that is no name": (
        ('mode = "full"', 'mode = "full"\ncomponents = ["vae..decode"]'),
        ["model[klein].components", "'vae..decode' is not a component"],
    ),
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
    assert "{'" not in result.stderr, "an entry dumped as a Python dict"
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
    assert err.value.message.endswith(": 2 problems")
    assert "model[klein].dtype" in str(err.value) and "model[klein].mdoe" in str(err.value)


def test_several_problems_print_one_per_line_not_as_escapes(tmp_path: Path, model_dir: Path, cli) -> None:
    text = GOOD.replace('dtype = "float32"', 'dtype = "f32"').replace('mode = "full"', 'mdoe = "full"')
    path = write(tmp_path, text)
    result = cli("plan", str(path))
    assert result.returncode == 2
    assert "\\x0a" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == f"error: {path}: 2 problems"
    assert [line.split(":")[0].strip() for line in lines[1:3]] == ["model[klein].dtype", "model[klein].mdoe"]
    assert lines[3].startswith("hint: ")
    as_json = cli("plan", str(path), "--json")
    assert len(json.loads(as_json.stdout)["details"]) == 2


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
    root = Path(__file__).resolve().parents[2]
    shipped = json.loads((root / "neffbuild" / "schema" / "manifest.schema.json").read_text())
    assert shipped == manifest_json_schema(), "regenerate: neffbuild schema > neffbuild/schema/manifest.schema.json"
    printed = cli("schema")
    assert printed.returncode == 0 and json.loads(printed.stdout) == shipped
    for manifest in sorted((root / "manifests").glob("*.toml")):
        jsonschema.validate(tomllib.loads(manifest.read_text()), shipped)


def test_schema_rejects_what_the_loader_rejects() -> None:
    schema = manifest_json_schema()
    bad = {
        "name": "x",
        "model": [{"id": "a", "model": "./m", "pipeline": "P", "shapes": {"height": 1, "width": 1}, "mdoe": "full"}],
    }
    with pytest.raises(jsonschema.ValidationError, match="mdoe"):
        jsonschema.validate(bad, schema)


# -- what a manifest means beyond its types ---------------------------------------------------------


def test_the_default_device_follows_the_backend(tmp_path: Path, model_dir: Path) -> None:
    neuron = load_manifest(write(tmp_path, GOOD.replace('mode = "full"', 'mode = "full"\nbackend = "neuron"')))
    assert neuron.manifest.models[0].device == "neuron"
    assert load_manifest(write(tmp_path, GOOD)).manifest.models[0].device == "cpu"


def test_store_resolves_against_the_manifest_directory(tmp_path: Path, model_dir: Path, monkeypatch) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a build started from another directory
    relative = load_manifest(write(tmp_path, GOOD.replace('name = "tiny"', 'name = "tiny"\nstore = "stores/ci"')))
    assert relative.manifest.store == str(tmp_path / "stores" / "ci")
    url = load_manifest(write(tmp_path, GOOD.replace('name = "tiny"', 'name = "tiny"\nstore = "s3://bucket/prefix"')))
    assert url.manifest.store == "s3://bucket/prefix"
    home = load_manifest(write(tmp_path, GOOD.replace('name = "tiny"', 'name = "tiny"\nstore = "~/stores"')))
    assert home.manifest.store == str(Path.home() / "stores")


def test_a_prompt_list_multiplies_the_images_per_call(tmp_path: Path, model_dir: Path) -> None:
    text = GOOD.replace("num_inference_steps = 2", 'num_inference_steps = 2\nprompt = ["a cat", "a dog"]')
    (entry,) = load_manifest(write(tmp_path, text)).manifest.models
    assert entry.prompts_per_call == 2
    assert [entry.unit_label(s) for s in entry.expanded_shapes()] == [
        "128x128x2",
        "128x128x4",
        "128x256x2",
        "128x256x4",
    ]


@pytest.mark.parametrize(
    ("relative", "content", "expected"),
    [
        ("vae/config.json", "[4, 4, 4, 4]", "not a JSON object (found list)"),
        ("vae/config.json", '{"block_out_channels": ', "not valid JSON"),
        ("vae/config.json", '{"block_out_channels": 4}', "block_out_channels is not a list of 1 to 8 numbers"),
        ("vae/config.json", "[" * 100000 + "]" * 100000, "not valid JSON (nested too deeply)"),
        ("model_index.json", '"Flux2KleinPipeline"', "not a JSON object (found str)"),
    ],
    # Short ids: the test's id goes into PYTEST_CURRENT_TEST, and a 200,000-character one makes the
    # environment of the CLI process it starts too long to exec.
    ids=["list", "truncated", "wrong-type", "nested-too-deeply", "index-not-object"],
)
def test_a_malformed_model_config_is_one_line_naming_the_file(
    relative: str, content: str, expected: str, tmp_path: Path, model_dir: Path, cli
) -> None:
    (model_dir / relative).write_text(content)
    result = cli("plan", str(write(tmp_path, GOOD)))
    assert result.returncode == 2, result.stderr
    error, hint = result.stderr.splitlines()
    assert str(model_dir / relative) in error and expected in error and hint.startswith("hint: ")


# -- property: no input gets past the loader as anything but a manifest or a ManifestError ---------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from neffbuild.documents.manifest import LoadedManifest  # noqa: E402

_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_KEYS = st.sampled_from(
    ["name", "model", "id", "pipeline", "dtype", "backend", "device", "mode", "components", "shapes", "height",
     "width", "batch", "call", "env", "store", "toolchain", "revision", "tensor_parallel", "shape_multiple",
     "prompt", "num_inference_steps", "OMP_NUM_THREADS", "description"]
) | _TEXT  # fmt: skip
_SCALARS = (
    st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, 2, 16, 128, 16384, 16385, 2**63, -1])
    | st.floats(allow_nan=True, allow_infinity=True)
    | _TEXT
    | st.sampled_from(
        ["./model", "float32", "neuron", "cpu", "full", "regional", "eager", "vae.decode", "s3://b/p", "ftp://x", "\0"]
    )
    | st.just(datetime.date(1979, 5, 27))
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=12,
)


def _toml_string(text: str) -> str:
    # JSON escapes are TOML escapes; TOML also wants DEL escaped.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(repr(value), repr(value))
    if isinstance(value, (int, datetime.date)):
        return str(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{_toml_string(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"


def _toml_document(data: dict) -> str:
    return "\n".join(f"{_toml_string(k)} = {_toml_value(v)}" for k, v in data.items()) + "\n"


_GOOD_DATA = tomllib.loads(GOOD)


@st.composite
def _mutated(draw) -> str:
    """The good manifest with values replaced, keys added or removed, at any depth."""
    data = json.loads(json.dumps(_GOOD_DATA))
    for _ in range(draw(st.integers(1, 3))):
        node = data
        for _ in range(draw(st.integers(0, 5))):
            children = [
                k
                for k, v in (node.items() if isinstance(node, dict) else enumerate(node))
                if isinstance(v, (dict, list)) and v
            ]
            if not children:
                break
            node = node[draw(st.sampled_from(children))]
        action = draw(st.sampled_from(["replace", "add", "remove"]))
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if action == "remove" and keys:
            del node[draw(st.sampled_from(keys))]
        elif action == "add" and isinstance(node, dict):
            node[draw(_KEYS)] = draw(_VALUES)
        elif keys:
            node[draw(st.sampled_from(keys))] = draw(_VALUES)
    return _toml_document(data)


_DOCUMENTS = (
    _mutated()
    | st.text(max_size=200)
    | st.builds(lambda n, c: "x = " + c[0] * n + c[1] * n, st.integers(0, 3000), st.sampled_from(["[]", "{}"]))
    | st.builds(lambda d: _toml_document(d), st.dictionaries(_KEYS, _VALUES, max_size=5))
)


@settings(
    max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(document=_DOCUMENTS)
def test_any_document_loads_or_is_a_manifest_error(document: str, tmp_path: Path, model_dir: Path) -> None:
    path = tmp_path / "fuzz.toml"
    path.write_bytes(document.encode("utf-8", "surrogatepass"))
    try:
        loaded = load_manifest(path)
    except ManifestError as exc:
        assert exc.exit_code == 2 and exc.message.startswith(str(path)) and exc.hint
        assert all(len(line) < 300 for line in exc.message.replace(str(path), "").splitlines()), "a value dumped whole"
    else:
        assert isinstance(loaded, LoadedManifest) and loaded.manifest.models
