"""The neuron backend: everything around the compiler, here; real compiles only where torch-neuronx is.

The end-to-end test drives build -> bundle -> store -> pull -> replay through the neuron backend
with tests/neuron_double.py, a TEST-ONLY compile backend registered under another name.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from neffbuild.backends import get_backend
from neffbuild.backends.neuron import COMPILE_BACKEND_ENV, DEVICE_ENV, TARGET_ENV, NeuronBackend
from neffbuild.backends.neuron_entry_checks import TP_TRANSFORMERS
from neffbuild.backends.neuron_toolchain import compile_target, instance_family
from neffbuild.backends.worker import group_rank, import_seams, writes_result
from neffbuild.documents.manifest import ModelEntry, ShapeSet, load_manifest
from neffbuild.errors import ManifestError
from neffbuild.units.plan import make_plan
from tests.conftest import write_model_index

TESTS = Path(__file__).resolve().parents[1]
NEFF = re.compile(r"^([0-9a-f]{2})/([0-9a-f]{2})/\1\2[0-9a-f]{28}\.neff$")
EAGER_NEFF = re.compile(r"^([0-9a-f]{64})/\1\.neff$")  # the Python compiler path's layout
VERSIONS = {
    "torch": "2.13.0",
    "torch-neuronx": "2.13.0.1",
    "neuronx-cc": "2.21.33",
    "diffusers": "0.42.1",
    "transformers": "5.0.0",
}


def backend_on(
    tmp_path: Path, product: str = "trn2.48xlarge", versions: dict | None = None, env=None, **kw
) -> NeuronBackend:
    dmi = tmp_path / "product_name"
    dmi.write_text(product + "\n")
    table = VERSIONS if versions is None else versions
    return NeuronBackend(version_of=table.get, product_name_file=dmi, env=env or {}, **kw)


# What `import torch_neuronx` 0.1.0 writes into os.environ when unset (__init__.py:41-65), with a
# release wheel's _build_config.py (BUILD_TYPE = "RELEASE").
RELEASE_IMPORT_DEFAULTS = {
    "JAX_LOGGING_LEVEL": "WARNING", "NEURON_LAUNCH_BLOCKING": "1", "TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS": "0",
    "TORCH_NEURONX_MLIR_ATEN_OPS": "1", "TORCH_NEURONX_RETAIN_DEVICE_MODE": "0", "NEURON_RT_ALLOW_LEGACY_NEFF": "1",
    "NEURON_RT_DBG_ZEROCOPY": "1", "TORCH_NEURONX_ENABLE_ASYNC_NRT": "1", "TORCH_NEURONX_ENABLE_STACK_TRACE": "0",
}  # fmt: skip


def fake_torch_neuronx(
    root: Path, build_type: str = "RELEASE", *, target: str = "trn2", lnc: str = "2", **changed_defaults: str
) -> Path:
    """A package named torch_neuronx that does at import what 0.1.0's does to the environment
    (and nothing else; metrics.set_enabled does nothing): for the planner's file reading and the
    worker's import. changed_defaults: a wheel that writes other defaults. Its utils answer the
    runtime's platform questions (target and logical cores, as nrt_get_instance_info would)."""
    package = root / "torch_neuronx"
    package.mkdir(parents=True)
    (package / "_build_config.py").write_text(f'BUILD_TYPE = "{build_type}"\n')
    defaults = {
        **RELEASE_IMPORT_DEFAULTS,
        "NEURON_LAUNCH_BLOCKING": "1" if build_type == "RELEASE" else "0",
        **changed_defaults,
    }
    (package / "__init__.py").write_text(
        "import os\n" + "".join(f"os.environ.setdefault({k!r}, {v!r})\n" for k, v in defaults.items())
    )
    (package / "metrics.py").write_text("def set_enabled(flag):\n    pass\n")
    (package / "utils.py").write_text(  # utils.py:254-265; the C++ side honours NEURON_LOGICAL_NC_CONFIG
        f"import os\n\n\ndef get_platform_target():\n    return {target!r}\n\n\n"
        f"def get_lnc_setting():\n    return os.environ.get('NEURON_LOGICAL_NC_CONFIG', {lnc!r})\n"
    )
    return package


def entry(**overrides) -> ModelEntry:
    fields = dict(
        id="m",
        model="./m",
        pipeline="Flux2KleinPipeline",
        backend="neuron",
        device="neuron",
        shapes=[ShapeSet(height=32, width=32)],
    )
    return ModelEntry(**{**fields, **overrides})


# -- fingerprint ---------------------------------------------------------------------------------


def test_fingerprint_names_every_field_from_injected_facts(tmp_path):
    backend = backend_on(tmp_path)
    facts = backend.collect_facts({}, "neuron")
    fp = backend.fingerprint(
        facts,
        {"NEURON_CC_FLAGS": "--model-type=transformer", "NEURON_COMPILER_OPT_LEVEL": "-O1"},
        entry(tensor_parallel=2),
    )
    assert fp["torch-neuronx"] == "2.13.0.1" and fp["neuronx-cc"] == "2.21.33"
    assert fp["torch"] == "2.13.0" and fp["diffusers"] == "0.42.1"
    assert fp["neuron.target"] == "trn2" and fp["neuron.lnc"] == "2"  # trn2's default logical cores
    assert fp["neuron.cc_flags"] == "--model-type=transformer" and fp["neuron.opt_level"] == "-O1"
    assert fp["neuron.tp"] == "2" and fp["backend"] == "neuron" and fp["device"] == "neuron"
    assert fp["neuron.compile_backend"] == "neuron" and fp["neuron.device"] == "neuron"


def test_compiler_version_changes_the_fingerprint(tmp_path):
    # TorchNeuron's own key omits the neuronx-cc version; ours must not.
    old = backend_on(tmp_path)
    new = backend_on(tmp_path, versions={**VERSIONS, "neuronx-cc": "2.22.0"})
    e = entry()
    assert old.fingerprint(old.collect_facts({}, "neuron"), {}, e) != new.fingerprint(
        new.collect_facts({}, "neuron"), {}, e
    )


def test_missing_packages_are_absent_and_target_can_be_overridden(tmp_path):
    backend = backend_on(tmp_path, product="Standard PC (Q35 + ICH9, 2009)", versions={})
    facts = backend.collect_facts({}, "neuron")
    fp = backend.fingerprint(facts, {}, entry())
    assert fp["torch-neuronx"] == "absent" and fp["neuronx-cc"] == "absent"
    assert fp["neuron.target"] == "unknown" and fp["neuron.lnc"] == "unknown"
    fp = backend.fingerprint(facts, {TARGET_ENV: "trn1", "NEURON_LOGICAL_NC_CONFIG": "1"}, entry())
    assert fp["neuron.target"] == "trn1" and fp["neuron.lnc"] == "1"


def test_instance_families_map_to_compile_targets():
    assert [compile_target(instance_family(p)) for p in ("trn2.48xlarge", "trn2u.48xlarge", "inf2.xlarge", "trn1n.32xlarge", "m5.large")] == [
        "trn2", "trn2", "trn1", "trn1", None,
    ]  # fmt: skip


# Read by torch_neuronx 0.1.0 at run time only; an earlier backend keyed and exported them.
ISSUE_RUNTIME_ONLY = (
    "NEURON_MAX_RESOURCE_SLOTS", "NEURON_FALLBACK_ENABLED", "NEURON_ENHANCED_ERROR_HANDLING",
    "TORCH_NEURONX_ENABLED_METRIC_TABLES", "TORCH_NEURONX_DYNAMO_DISABLE_CPU_AUTOCOPY",
)  # fmt: skip


def test_worker_and_runtime_only_variables_do_not_split_keys(tmp_path):
    backend = backend_on(tmp_path)
    facts = backend.collect_facts({}, "neuron")
    base = {"TORCH_NEURONX_ENABLE_NKI_SDPA": "0"}
    plan_fp = backend.fingerprint(facts, base, entry())
    worker = {**base, **backend.worker_env(tmp_path / "cache", tmp_path), "NEURON_RT_VISIBLE_CORES": "0-3", "RANK": "1"}
    assert backend.fingerprint(facts, worker, entry()) == plan_fp
    assert plan_fp["env.TORCH_NEURONX_ENABLE_NKI_SDPA"] == "0"  # changes the decomposition: keyed
    # Names 0.1.0 reads only at run time, and names it does not read at all, split nothing.
    runtime = dict.fromkeys(ISSUE_RUNTIME_ONLY, "1") | {"TORCH_NEURONX_COMPLEX_DECOMPOSE": "0"}
    assert backend.fingerprint(facts, {**base, **runtime}, entry()) == plan_fp


def test_venv_path_and_model_library_versions_change_the_key_and_break_a_host(tmp_path):
    # The persistent key hashes bytecode carrying source locations (fx_importer.py:28-41): paths
    # and line numbers of the model code, so where it is installed and which version it is split keys.
    from neffbuild.documents.records import unit_key

    here = backend_on(tmp_path, prefix="/opt/neffbuild/venv")
    fp = here.fingerprint(here.collect_facts({}, "neuron"), {}, entry())
    elsewhere = backend_on(tmp_path, prefix="/home/ci/venv")
    moved = elsewhere.fingerprint(elsewhere.collect_facts({}, "neuron"), {}, entry())
    newer = backend_on(tmp_path, prefix="/opt/neffbuild/venv", versions={**VERSIONS, "diffusers": "0.43.0"})
    upgraded = newer.fingerprint(newer.collect_facts({}, "neuron"), {}, entry())
    assert fp["venv"] == "/opt/neffbuild/venv" and moved["venv"] == "/home/ci/venv"
    assert len({unit_key({"u": 1}, f) for f in (fp, moved, upgraded)}) == 3
    assert all(
        here.is_breaking(name) for name in ("venv", "diffusers", "transformers", "python", "neuronx-cc.bin-version")
    )
    assert not here.is_breaking("neuronx-cc.bin")  # another path to the same compiler version


def test_import_time_defaults_limits_and_the_lock_timeout_do_not_split_keys(tmp_path):
    backend = backend_on(tmp_path, package_dir=lambda name: fake_torch_neuronx(tmp_path / "site"))
    facts = backend.collect_facts({}, "neuron")
    assert facts["torch-neuronx.build"] == "RELEASE"
    planned = backend.fingerprint(facts, {}, entry())  # before `import torch_neuronx`
    assert planned["neuron.sync"] == "1"  # a release wheel compiles eager ops synchronously
    runtime_only = {
        "NEURON_COMPILATION_CACHE_MAX_SIZE_MB": "512", "NEURON_COMPILATION_CACHE_MAX_ENTRIES": "10",
        "TORCH_NEURONX_NEFF_CACHE_LOCK_TIMEOUT": "30",
    }  # fmt: skip
    assert backend.fingerprint(facts, {**RELEASE_IMPORT_DEFAULTS, **runtime_only}, entry()) == planned
    # What changes the cache does change the key: asynchronous eager ops, another lowering.
    assert backend.fingerprint(facts, {"NEURON_LAUNCH_BLOCKING": "0"}, entry())["neuron.sync"] == "0"
    assert (
        backend.fingerprint(facts, {"TORCH_NEURONX_MLIR_ATEN_OPS": "0"}, entry())["env.TORCH_NEURONX_MLIR_ATEN_OPS"]
        == "0"
    )
    dev = backend_on(tmp_path, package_dir=lambda name: fake_torch_neuronx(tmp_path / "dev", "DEV"))
    assert dev.fingerprint(dev.collect_facts({}, "neuron"), {}, entry())["neuron.sync"] == "0"


def test_set_but_empty_is_not_unset(tmp_path):
    backend = backend_on(tmp_path)
    facts = backend.collect_facts({}, "neuron")
    unset = backend.fingerprint(facts, {}, entry())
    for name, field in (
        ("NEURON_CC_FLAGS", "neuron.cc_flags"),
        ("NEURON_COMPILER_OPT_LEVEL", "neuron.opt_level"),
        ("NEURON_LOGICAL_NC_CONFIG", "neuron.lnc"),
    ):
        empty = backend.fingerprint(facts, {name: ""}, entry())
        assert empty[field] == "" and empty[field] != unset[field], name


def test_the_neuronx_cc_on_path_is_recorded_and_pinned(tmp_path):
    bin_dir = tmp_path / "other" / "bin"
    bin_dir.mkdir(parents=True)
    compiler = bin_dir / "neuronx-cc"
    compiler.write_text("#!/bin/sh\necho 'NeuronX Compiler version 2.19.5+abc'\n")
    compiler.chmod(0o755)
    backend = backend_on(tmp_path, prefix=str(tmp_path / "venv"))
    facts = backend.collect_facts({"PATH": f"{bin_dir}:/usr/bin"}, "neuron")
    assert facts["neuronx-cc.bin"] == str(compiler) and facts["neuronx-cc.bin-version"] == "2.19.5+abc"  # it ran
    assert backend.collect_facts({"PATH": "/usr/bin"}, "neuron")["neuronx-cc.bin"] == "absent"
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "neuronx-cc").symlink_to(compiler)
    mine = backend.collect_facts({"PATH": f"{venv_bin}:{bin_dir}"}, "neuron")
    assert mine["neuronx-cc.bin-version"] == VERSIONS["neuronx-cc"]  # this venv's: its metadata
    # A worker puts the dir of the compiler it was keyed with first, absolute (it runs in a temp dir).
    from neffbuild.backends.neuron_toolchain import pin_compiler

    environ = {"PATH": "relative/bin:/usr/bin"}
    (tmp_path / "relative" / "bin").mkdir(parents=True)
    (tmp_path / "relative" / "bin" / "neuronx-cc").symlink_to(compiler)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert pin_compiler(environ) == tmp_path / "relative" / "bin" / "neuronx-cc"
    finally:
        os.chdir(cwd)
    assert environ["PATH"].split(":")[0] == str(tmp_path / "relative" / "bin")


def test_seams_are_fingerprint_fields(tmp_path):
    backend = backend_on(tmp_path)
    facts = backend.collect_facts({}, "neuron")
    fp = backend.fingerprint(facts, {COMPILE_BACKEND_ENV: "neffbuild_neuron_double", DEVICE_ENV: "cpu"}, entry())
    assert fp["neuron.compile_backend"] == "neffbuild_neuron_double" and fp["neuron.device"] == "cpu"
    assert fp != backend.fingerprint(facts, {}, entry())


def test_real_facts_do_not_need_torch_neuronx():
    facts = NeuronBackend().collect_facts(dict(os.environ), "neuron")
    assert facts["torch"].startswith("2.")
    if not _has_torch_neuronx():
        assert facts["torch-neuronx"] == "absent" and facts["neuronx-cc"] == "absent"
    assert "torch_neuronx" not in sys.modules  # planning never starts the Neuron runtime


# -- validation (mode and tensor parallel) -------------------------------------------------------


def write_model(root: Path, class_name: str, heads: int | None) -> None:
    (root / "transformer").mkdir(parents=True)
    write_model_index(root)
    config = {"_class_name": class_name, **({"num_attention_heads": heads} if heads else {})}
    (root / "transformer" / "config.json").write_text(json.dumps(config))


def manifest(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "neffbuild.toml"
    path.write_text('name = "t"\n' + body)
    return path


def model_toml(model: str, pipeline: str, tp: int, extra: str = "") -> str:
    return (
        f'[[model]]\nid = "m"\nmodel = "{model}"\npipeline = "{pipeline}"\nbackend = "neuron"\n'
        f'device = "neuron"\ntensor_parallel = {tp}\nshapes = {{height = 32, width = 32}}\n{extra}'
    )


@pytest.mark.parametrize(
    ("class_name", "heads", "tp", "problem"),
    [
        ("Flux2Transformer2DModel", 24, 4, None),
        ("Flux2Transformer2DModel", 2, 4, "does not divide the transformer's num_attention_heads (2)"),
        ("QwenImageTransformer2DModel", None, 8, None),
        ("SD3Transformer2DModel", 24, 2, "SD3Transformer2DModel has no _tp_plan"),
        ("SD3Transformer2DModel", 24, 1, None),
    ],
)
def test_tensor_parallel_is_validated_from_the_local_config(tmp_path, class_name, heads, tp, problem):
    write_model(tmp_path / "m", class_name, heads)
    loaded = load_manifest(manifest(tmp_path, model_toml("./m", "Flux2KleinPipeline", tp)))
    problems = NeuronBackend().validate(loaded.manifest.models[0], loaded)
    assert (problems == []) if problem is None else any(problem in str(p) for p in problems)


def test_hub_models_are_validated_by_pipeline(tmp_path):
    extra = 'revision = "0123abcd"\n'
    flux = load_manifest(manifest(tmp_path, model_toml("black-forest-labs/FLUX.1-dev", "FluxPipeline", 2, extra)))
    assert NeuronBackend().validate(flux.manifest.models[0], flux) == []
    sd3 = load_manifest(manifest(tmp_path, model_toml("stabilityai/sd3", "StableDiffusion3Pipeline", 2, extra)))
    assert "cannot confirm" in str(NeuronBackend().validate(sd3.manifest.models[0], sd3)[0])


def test_plan_refuses_an_invalid_tensor_parallel_degree(tmp_path):
    write_model(tmp_path / "m", "Flux2Transformer2DModel", 2)
    loaded = load_manifest(manifest(tmp_path, model_toml("./m", "Flux2KleinPipeline", 4)))
    with pytest.raises(ManifestError, match=r"model\[m\]\.tensor_parallel: 4 does not divide"):
        make_plan(loaded, {})


def test_the_tp_table_matches_installed_diffusers():
    diffusers = pytest.importorskip("diffusers")
    has_plan = {
        name
        for name in dir(diffusers)
        if isinstance(getattr(diffusers, name, None), type) and getattr(getattr(diffusers, name), "_tp_plan", None)
    }
    assert has_plan == TP_TRANSFORMERS


def test_manifest_keeps_neuron_on_its_device():
    with pytest.raises(ValueError, match="does not suit backend"):
        entry(device="cpu")
    with pytest.raises(ValueError, match="tensor_parallel > 1 needs backend"):
        entry(backend="inductor", device="cpu", tensor_parallel=2)


def test_planning_needs_the_compiler_or_a_declared_toolchain(tmp_path):
    backend = backend_on(tmp_path, product="Standard PC (Q35 + ICH9, 2009)", versions={"torch": "2.13.0"})
    if not _has_torch_neuronx():
        (problem,) = backend.check_host(entry(), {}, declared=False)
        assert (
            problem.field == "backend"
            and "torch-neuronx is not importable" in problem.message
            and "[toolchain]" in problem.hint
        )
    assert backend.check_host(entry(), {}, declared=True) == []  # planning for the host [toolchain] declares
    (tmp_path / "other").mkdir()
    installed = backend_on(tmp_path / "other", package_dir=lambda name: tmp_path / "site" / name)
    (problem,) = installed.check_host(entry(), {"PATH": str(tmp_path / "other")}, declared=False)
    assert "no neuronx-cc is on PATH" in problem.message and "bin dir first on PATH" in problem.hint
    assert backend.check_host(entry(), {COMPILE_BACKEND_ENV: "neffbuild_neuron_double"}, declared=False) == []
    facts = backend.collect_facts({}, "neuron")
    assert backend.unusable_facts(facts, {}) == ["torch-neuronx", "neuronx-cc", "diffusers", "transformers", "target"]
    declared = {**facts, **VERSIONS, "target": "trn2"}
    # Which layout eager ops land in depends on the wheel's build: declared, or set explicitly.
    assert backend.unusable_facts(declared, {}) == ["torch-neuronx.build"]
    assert backend.unusable_facts(declared, {"NEURON_LAUNCH_BLOCKING": "1"}) == []
    declared["torch-neuronx.build"] = "RELEASE"
    assert backend.unusable_facts(declared, {}) == []
    assert backend.fingerprint(declared, {}, entry())["neuron.target"] == "trn2"
    assert backend.unusable_facts(facts, {COMPILE_BACKEND_ENV: "neffbuild_neuron_double"}) == []


def test_the_target_comes_from_the_instance_type_when_not_declared(tmp_path):
    facts = backend_on(tmp_path, product="trn1.32xlarge").collect_facts({}, "neuron")
    assert facts["target"] == "trn1" and facts["instance.type"] == "trn1.32xlarge"
    assert NeuronBackend().fingerprint(facts, {TARGET_ENV: "trn2"}, entry())["neuron.target"] == "trn2"


# -- every listed component is compiled through a graph counter -----------------------------------


def _tiny_pipe():
    import torch

    class Vae(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(4, 8)

        def forward(self, x):
            return self.up(x)

        def decode(self, z):
            return torch.tanh(self.up(z))

    class Transformer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.nn.functional.gelu(self.proj(x))

    class Pipe:
        def __init__(self) -> None:
            self.transformer = Transformer()
            self.vae = Vae()

        def to(self, device):
            return self

        def __call__(self, x):
            return self.vae.decode(self.transformer(x))

    return Pipe()


def test_components_compile_through_the_real_compiler_and_count_their_graphs(tmp_path, monkeypatch, request):
    import torch
    from torch._dynamo.utils import counters

    from neffbuild.backends.base import components_without_graphs
    from tests import neuron_double  # registers the substitute compile backend and its eager hook

    request.addfinalizer(neuron_double.EAGER_HOOK.remove)  # the hook is process-wide: not for later tests
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("NEURON_LAUNCH_BLOCKING", "1")  # eager ops to the second layout, graphs alone in the first
    backend = NeuronBackend(env={COMPILE_BACKEND_ENV: "neffbuild_neuron_double", DEVICE_ENV: "cpu"})
    torch._dynamo.reset()
    counters.clear()
    for listed, silent in ((("transformer", "vae.decode"), []), (("transformer", "vae"), ["vae"])):
        e = entry(device="neuron", components=listed)
        pipe = backend.apply_mode(_tiny_pipe(), e)
        before = backend.counters()
        pipe(torch.randn(2, 4))
        after = backend.counters()
        delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        assert delta.get("graphs.transformer") == 1
        assert components_without_graphs(e, delta) == silent
        # The counter delegates: the substitute compiler saw the graphs and wrote its cache files.
        assert (
            delta.get("neuron.CompilationCache.PersistentMisses", 0)
            + delta.get("neuron.CompilationCache.PersistentHits", 0)
            >= 1
        )
    graphs = [f for f in backend.select_files(tmp_path / "cache") if NEFF.match(f)]
    assert len(graphs) == 2  # transformer and vae.decode graphs


@pytest.mark.parametrize("name", ["inductor", "neuron"])
def test_every_backend_raises_the_recompile_limit_above_the_shape_count(name):
    """The shared step: the ninth static shape must not fail under fullgraph=True."""
    import torch._dynamo

    backend = (
        get_backend("inductor")
        if name == "inductor"
        else NeuronBackend(env={COMPILE_BACKEND_ENV: "inductor", DEVICE_ENV: "cpu"})
    )
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=8):  # restored afterwards
        backend.prepare_process(20)
        assert torch._dynamo.config.recompile_limit >= 20 and torch._dynamo.config.accumulated_recompile_limit >= 256


def test_every_from_pretrained_gets_the_entrys_dtype_and_revision():
    import torch

    from neffbuild.backends.base import load_arguments

    assert load_arguments(entry(dtype="bfloat16", revision="abc")) == {"torch_dtype": torch.bfloat16, "revision": "abc"}
    assert load_arguments(entry(dtype="float32")) == {"torch_dtype": torch.float32}


def test_a_component_without_graphs_gets_a_hint_naming_the_method():
    from neffbuild.backends.base import no_graph_hint

    assert "list 'vae.decode'" in no_graph_hint("vae")
    assert "never called vae.decode" in no_graph_hint("vae.decode")


# -- cache files ---------------------------------------------------------------------------------


def touch(root: Path, rel: str, data: bytes = b"x") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_select_files_takes_torchneuron_entries_only(tmp_path):
    good = ["ab/cd/abcd" + "0" * 28 + ".neff", "01/23/0123" + "f" * 28 + ".neff"]
    for rel in good:
        touch(tmp_path, rel)
    for rel in (
        "ab/cd/.tmp.Xy12Qz",  # TorchNeuron's temp file before the rename
        "ab/cd/ffff" + "0" * 28 + ".neff",  # shard dirs disagree with the key
        "ab/cd/abcd" + "0" * 27 + ".neff",  # not 32 hex
        "AB/CD/ABCD" + "0" * 28 + ".neff",
        "locks/abcd.lock",
        ".neffbuild/state.json",
        "neuron-debug/graph.hlo",
    ):
        touch(tmp_path, rel)
    (tmp_path / "ab" / "cd" / ("abce" + "0" * 28 + ".neff")).symlink_to(tmp_path / good[0])
    assert NeuronBackend().select_files(tmp_path) == sorted(good)


def test_select_files_takes_only_finished_libneuronxla_entries(tmp_path):
    root = "neuronxcc-2.21.33+abc"
    done = f"{root}/MODULE_111+aaa"
    for name in ("model.neff", "model.done", "compile_flags.json", "model.hlo_module.pb", "model.log"):
        touch(tmp_path, f"{done}/{name}")
    older = f"{root}/MODULE_222+bbb"
    for name in ("model.neff", "model.done", "compile_flags.txt", "model.hlo.pb"):
        touch(tmp_path, f"{older}/{name}")
    for name in ("model.hlo_module.pb", "model.log"):  # a cached failure: poisoned
        touch(tmp_path, f"{root}/MODULE_333+ccc/{name}")
    for name in ("model.neff", "model.done", "model.hlo_module.pb", "model.neff.lock"):  # in progress
        touch(tmp_path, f"{root}/MODULE_444+ddd/{name}")
    for name in ("model.hlo_module.pb", "model.neff"):  # no success marker yet
        touch(tmp_path, f"{root}/MODULE_555+eee/{name}")
    expected = [f"{done}/{n}" for n in ("compile_flags.json", "model.done", "model.hlo_module.pb", "model.neff")]
    expected += [f"{older}/{n}" for n in ("compile_flags.txt", "model.done", "model.hlo.pb", "model.neff")]
    assert NeuronBackend().select_files(tmp_path) == sorted(expected)


def test_select_files_takes_the_python_compiler_paths_entries(tmp_path):
    key, other = "ab" * 32, "0123456789abcdef" * 4
    good = [f"{key}/{key}.neff", f"{other}/{other}.neff", "ab/cd/abcd" + "0" * 28 + ".neff"]
    for rel in good:
        touch(tmp_path, rel)
    for rel in (
        f"{key}/tmpk3j_x8a1.tmp",  # cache_utils.atomic_write_bytes before its rename
        f"{key}/{other}.neff",  # dir disagrees with the key
        f"{key[:63]}/{key[:63]}.neff",  # not 64 hex
        f"{key}/locks/compile.lock",  # its lock, were the local dir the cache dir
    ):
        touch(tmp_path, rel)
    (tmp_path / ("cd" * 32)).mkdir()
    (tmp_path / ("cd" * 32) / f"{'cd' * 32}.neff").symlink_to(tmp_path / good[0])
    assert NeuronBackend().select_files(tmp_path) == sorted(good)
    assert NeuronBackend().is_content_keyed(f"{key}/{key}.neff") and not NeuronBackend().is_content_keyed(
        f"{key}/{other}.neff"
    )


def test_a_new_python_path_entry_counts_as_a_compile(tmp_path):
    from neffbuild.backends.neuron import SUBPROCESS_FILES

    backend = NeuronBackend(
        env={COMPILE_BACKEND_ENV: "neffbuild_counter_probe2", "TORCH_NEURONX_NEFF_CACHE_DIR": str(tmp_path)}
    )
    key = "ef" * 32
    touch(tmp_path, f"{key}/{key}.neff")
    before = backend.counters()
    for n in ("01", "02"):
        touch(tmp_path, f"{n * 32}/{n * 32}.neff")
    touch(tmp_path, f"{'03' * 32}/tmpabc.tmp")  # not (yet) an entry
    after = backend.counters()
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta[SUBPROCESS_FILES] == 2 and backend.compiles_in(delta) == 2


def test_both_layouts_are_content_keyed():
    backend = NeuronBackend()
    assert backend.is_content_keyed("ab/cd/abcd" + "0" * 28 + ".neff")
    assert backend.is_content_keyed("neuronxcc-2.21.33/MODULE_111+aaa/model.neff")
    assert not backend.is_content_keyed("locks/abcd.lock")
    assert not backend.is_content_keyed("ab/cd/ffff" + "0" * 28 + ".neff")


def test_worker_env_keeps_locks_and_debug_out_of_the_cache_dir(tmp_path):
    cache, scratch = tmp_path / "s" / "cache", tmp_path / "s"
    env = NeuronBackend().worker_env(cache, scratch)
    assert env["TORCH_NEURONX_NEFF_CACHE_DIR"] == str(cache)
    for name in ("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", "TORCH_NEURONX_DEBUG_DIR", "TORCH_NEURONX_HLO_CACHE_DIR"):
        assert Path(env[name]).parent == scratch and not Path(env[name]).is_relative_to(cache)
    assert get_backend("neuron").cache_env == "TORCH_NEURONX_NEFF_CACHE_DIR"
    assert NeuronBackend().runtime_env() == {}


# -- worker side ---------------------------------------------------------------------------------


def test_tensor_parallel_launches_one_process_per_core(tmp_path):
    job = tmp_path / "job.json"
    assert NeuronBackend().launch_command(entry(), job) == [sys.executable, "-m", "neffbuild.backends.worker", str(job)]
    command = NeuronBackend().launch_command(entry(tensor_parallel=4), job)
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc_per_node=4" in command and "--standalone" in command
    assert command[-3:] == ["-m", "neffbuild.backends.worker", str(job)]


def test_only_rank_zero_writes_the_result_and_seams_import():
    assert writes_result({}) and writes_result({"RANK": "0"}) and not writes_result({"RANK": "3"})
    assert group_rank({"RANK": "1", "WORLD_SIZE": "2"}) == (1, 2) and group_rank({"RANK": "x"}) == (0, 1)
    import_seams({"NEFFBUILD_WORKER_IMPORTS": "json, colorsys"})
    assert "colorsys" in sys.modules
    with pytest.raises(ModuleNotFoundError):
        import_seams({"NEFFBUILD_WORKER_IMPORTS": "no_such_module_here"})


def test_tensor_parallel_runs_every_rank_under_torchrun_and_rank_zero_reports(tmp_path):
    # Here no rank can reach a NeuronCore: each fails in prepare_process, which is enough to show
    # that the launch command starts N ranks of the worker and that only rank 0 writes the result.
    if _has_torch_neuronx():
        pytest.skip("torch-neuronx is installed: the real TP path is covered on Trainium")
    from neffbuild.documents.manifest import Shape
    from neffbuild.errors import BuildError
    from neffbuild.runner.jobfiles import WorkerJob
    from neffbuild.runner.workers import run_worker

    e = entry(model="/nonexistent", tensor_parallel=2)
    job = WorkerJob(
        purpose="build",
        entry=e,
        model_ref="/nonexistent",
        unit_ids=("m/32x32x1",),
        shapes=(Shape(height=32, width=32),),
    )
    backend = NeuronBackend()
    env = {**os.environ, **backend.worker_env(tmp_path / "cache", tmp_path)}
    # torchrun stops the group at the first failing rank, so which rank is heard is a race; each
    # knows from torchrun that the group has 2.
    with pytest.raises(
        BuildError, match=r"m/32x32x1: worker failed: rank [01] of 2: RuntimeError: torch-neuronx is not importable"
    ):
        run_worker(lambda job_file: backend.launch_command(e, job_file), job, env, tmp_path)
    assert {p.name for p in tmp_path.glob("*result.json")} <= {"job.result.json", "job.rank1.result.json"}


def test_a_failing_rank_is_heard_when_rank_zero_was_stopped_before_it_could_write(tmp_path):
    # As torchrun does when rank 1 fails first: rank 0 is stopped (here: never started).
    from neffbuild.documents.manifest import Shape
    from neffbuild.errors import BuildError
    from neffbuild.runner.jobfiles import WorkerJob
    from neffbuild.runner.workers import run_worker

    e = entry(model="/nonexistent", tensor_parallel=2)
    job = WorkerJob(
        purpose="build",
        entry=e,
        model_ref="/nonexistent",
        unit_ids=("m/32x32x1",),
        shapes=(Shape(height=32, width=32),),
    )
    env = {**os.environ, **NeuronBackend().worker_env(tmp_path / "cache", tmp_path), "RANK": "1", "WORLD_SIZE": "2"}
    group = ["bash", "-c", '"$0" -m neffbuild.backends.worker "$1"; exit 1', sys.executable]
    with pytest.raises(
        BuildError, match=r"m/32x32x1: worker failed: rank 1 of 2: RuntimeError: torch-neuronx is not importable"
    ):
        run_worker(lambda job_file: [*group, str(job_file)], job, env, tmp_path)
    assert not (tmp_path / "job.result.json").exists() and (tmp_path / "job.rank1.result.json").is_file()


def test_a_substitute_backend_reports_in_dynamo_counters():
    from torch._dynamo.utils import counters

    backend = NeuronBackend(env={COMPILE_BACKEND_ENV: "neffbuild_counter_probe"})
    before = backend.counters()
    counters["neffbuild_counter_probe"]["CompilationCache.TotalCompilations"] += 3
    counters["neffbuild_counter_probe"]["CompilationCache.PersistentHits"] += 5
    after = backend.counters()
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert backend.compiles_in(delta) == 3 and delta["neuron.CompilationCache.PersistentHits"] == 5


def test_without_torch_neuronx_the_worker_says_so():
    if "torch_neuronx" in sys.modules or _has_torch_neuronx():
        pytest.skip("torch-neuronx is installed here")
    with pytest.raises(RuntimeError, match="torch-neuronx is not importable"):
        NeuronBackend(env={}).prepare_process(1)


def _has_torch_neuronx() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_neuronx") is not None


# -- real compiles: only where torch-neuronx and a Neuron device are -----------------------------

REAL_COMPILE = """
import sys, torch
from neffbuild.backends.neuron import NeuronBackend
b = NeuronBackend()
b.prepare_process(1)
m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).to("neuron")
m.compile(backend="neuron", fullgraph=True, dynamic=False)
before = b.counters()
m(torch.randn(4, 16, device="neuron"))
after = b.counters()
print(b.compiles_in({k: after[k] - before.get(k, 0) for k in after}))
"""


def _real_compile(cache: Path, scratch: Path) -> int:
    env = {**os.environ, **NeuronBackend().worker_env(cache, scratch)}
    out = subprocess.run([sys.executable, "-c", REAL_COMPILE], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_real_neuron_compile_fills_the_documented_layout_and_hits_on_rerun(tmp_path):
    pytest.importorskip("torch_neuronx", reason="torch-neuronx is not installed (real compiles run only on Trainium)")
    cache = tmp_path / "cache"
    assert _real_compile(cache, tmp_path / "a") >= 1
    files = NeuronBackend().select_files(cache)
    # The graph in the first layout; eager ops around it (randn on the device) in the second in
    # synchronous mode (a release wheel's default), else in the first. Nothing in a third.
    assert any(NEFF.match(f) for f in files) and all(NEFF.match(f) or EAGER_NEFF.match(f) for f in files)
    assert NeuronBackend().unrecognised_files(cache) == []
    assert _real_compile(cache, tmp_path / "b") == 0  # a fresh process loads every NEFF from disk
    assert NeuronBackend().select_files(cache) == files


# -- build -> bundle -> store -> pull -> replay through the neuron backend, with the double ------

DOUBLE_ENV = {
    COMPILE_BACKEND_ENV: "neffbuild_neuron_double",
    DEVICE_ENV: "cpu",
    "NEFFBUILD_WORKER_IMPORTS": "neuron_double",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
E2E_MANIFEST = """
name = "tiny-neuron"

[[model]]
id = "klein"
model = "./tiny"
pipeline = "Flux2KleinPipeline"
dtype = "float32"
backend = "neuron"
device = "neuron"
mode = "regional"
shapes = { height = 32, width = [32, 64] }
call = { num_inference_steps = 2, max_sequence_length = 64, text_encoder_out_layers = [1] }
"""


@pytest.mark.slow
def test_build_bundle_store_pull_replay_through_the_neuron_backend(tmp_path, tiny_model, cli):
    from neffbuild.build.compile import build
    from neffbuild.host.pull import pull
    from neffbuild.host.verify import check_files, replay
    from neffbuild.store import open_store

    (tmp_path / "tiny").symlink_to(tiny_model)
    path = tmp_path / "neffbuild.toml"
    path.write_text(E2E_MANIFEST)
    env = {**os.environ, **DOUBLE_ENV, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    plan = make_plan(load_manifest(path), env)
    assert {u.fingerprint["neuron.compile_backend"] for u in plan.units} == {"neffbuild_neuron_double"}

    store_dir = tmp_path / "store"
    store = open_store(str(store_dir), create=True)
    report = build(plan, store, env=env)
    assert [o.status for o in report.outcomes] == ["built", "built"], [o.error for o in report.outcomes]
    assert all(o.compiles >= 1 and o.files >= 1 for o in report.outcomes)
    assert report.tag == "tiny-neuron"
    for unit in plan.units:  # regional: one graph per block class, counted for the component
        assert json.loads(store.get_doc("bundles", unit.key))["counters"]["graphs.transformer"] >= 2

    cache = tmp_path / "serving-cache"
    pulled = pull(store, "tiny-neuron", cache)
    assert pulled.exports["TORCH_NEURONX_NEFF_CACHE_DIR"] == str(cache.resolve())
    files = NeuronBackend().select_files(cache)
    assert len(files) == pulled.files_total and all(NEFF.match(f) for f in files)
    assert not [p for p in cache.rglob("*.lock") if ".neffbuild" not in p.parts]  # compiler locks never travel
    assert all(r.ok for r in check_files(plan, store, cache))

    # Serving replay in a fresh process over the pulled dir: every graph found, nothing written.
    replayed = replay(plan, cache, env=env)
    assert not replayed.misses and len(replayed.units) == 2
    assert all(u.counters.get("neuron.CompilationCache.PersistentHits", 0) >= 1 for u in replayed.units)

    exported = cli("env", "tiny-neuron", "--store", str(store_dir), "--cache-dir", str(cache))
    assert exported.returncode == 0 and f"export TORCH_NEURONX_NEFF_CACHE_DIR={cache.resolve()}" in exported.stdout

    again = build(plan, store, env=env)
    assert [o.status for o in again.outcomes] == ["present", "present"] and again.release_id == report.release_id


@pytest.mark.slow
def test_fail_fast_through_the_neuron_backend_stops_after_the_call_that_compiled(tmp_path, tiny_model):
    # TorchNeuron counts a compile only once it ran (NeuronBackend.watch_compiles): the replay
    # cannot stop the call, but replays no unit after it, and says which way it stopped.
    from neffbuild.host.verify import ReplayHow, miss_error, replay

    (tmp_path / "tiny").symlink_to(tiny_model)
    (tmp_path / "neffbuild.toml").write_text(E2E_MANIFEST)
    env = {**os.environ, **DOUBLE_ENV, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    plan = make_plan(load_manifest(tmp_path / "neffbuild.toml"), env)
    empty = tmp_path / "empty-cache"
    empty.mkdir()
    report = replay(plan, empty, env=env, how=ReplayHow(fail_fast=True))
    (unit,) = report.units
    assert unit.unit_id == plan.units[0].unit_id and unit.compiles >= 1 and not unit.stopped
    assert report.not_replayed == (plan.units[1].unit_id,)
    error = miss_error(report)
    assert error is not None and error.exit_code == 6
    assert f"{unit.unit_id} compiled, stopped after its call; 1 of 2 units not replayed" in error.message


# The Python compiler path: eager ops in synchronous mode (a release wheel's default), second layout.
SYNC_MANIFEST = """
name = "tiny-neuron-sync"

[[model]]
id = "eager"
model = "./tiny"
pipeline = "Flux2KleinPipeline"
dtype = "float32"
backend = "neuron"
device = "neuron"
mode = "eager"
shapes = { height = 32, width = 32 }
call = { num_inference_steps = 2, max_sequence_length = 64, text_encoder_out_layers = [1] }
env = { NEURON_LAUNCH_BLOCKING = "1" }

[[model]]
id = "regional"
model = "./tiny"
pipeline = "Flux2KleinPipeline"
dtype = "float32"
backend = "neuron"
device = "neuron"
mode = "regional"
shapes = { height = 32, width = 32 }
call = { num_inference_steps = 2, max_sequence_length = 64, text_encoder_out_layers = [1] }
env = { NEURON_LAUNCH_BLOCKING = "1" }
"""


@pytest.mark.slow
def test_synchronous_eager_ops_are_bundled_counted_and_replay_from_a_pull_with_both_layouts(tmp_path, tiny_model):
    from neffbuild.build.compile import build
    from neffbuild.host.pull import pull
    from neffbuild.host.verify import replay
    from neffbuild.store import open_store

    (tmp_path / "tiny").symlink_to(tiny_model)
    path = tmp_path / "neffbuild.toml"
    path.write_text(SYNC_MANIFEST)
    env = {**os.environ, **DOUBLE_ENV, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    plan = make_plan(load_manifest(path), env)
    assert {u.fingerprint["neuron.sync"] for u in plan.units} == {"1"}
    store = open_store(str(tmp_path / "store"), create=True)
    report = build(plan, store, env=env)
    assert [o.status for o in report.outcomes] == ["built", "built"], [o.error for o in report.outcomes]
    eager, regional = report.outcomes
    files = {u.unit_id: [f.path for f in load_bundle(store, u.key).files] for u in plan.units}
    # Eager: every op through the Python path, counted by its new files (no upstream counter does).
    assert files[eager.unit_id] and all(EAGER_NEFF.match(f) for f in files[eager.unit_id])
    assert eager.compiles == len(files[eager.unit_id])
    # Regional: the blocks' graphs in the first layout, what runs around them in the second.
    assert any(NEFF.match(f) for f in files[regional.unit_id]) and any(
        EAGER_NEFF.match(f) for f in files[regional.unit_id]
    )
    assert regional.compiles >= 1

    cache = tmp_path / "serving-cache"
    pulled = pull(store, "tiny-neuron-sync", cache)
    assert pulled.exports["NEURON_LAUNCH_BLOCKING"] == "1"  # the server runs in the mode the build did
    on_disk = NeuronBackend().select_files(cache)
    assert any(NEFF.match(f) for f in on_disk) and any(EAGER_NEFF.match(f) for f in on_disk)
    assert not [p for p in cache.rglob("*.lock") if ".neffbuild" not in p.parts]
    replayed = replay(plan, cache, env=env)
    assert not replayed.misses and [u.compiles for u in replayed.units] == [0, 0]
    # That 0 means something: without one second-layout entry, each unit holding it compiles it again.
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(cache, damaged, symlinks=True)
    gone = next(f for f in on_disk if EAGER_NEFF.match(f))
    (damaged / gone).chmod(0o644)
    (damaged / gone).unlink()
    missed = replay(plan, damaged, env=env)
    assert {u.unit_id: u.compiles for u in missed.units} == {u: int(gone in f) for u, f in files.items()}
    # A wheel that writes that compile in another layout: no counter counts it, yet replay sees
    # the new file and calls it a miss (it used to watch the bundled layouts only).
    elsewhere = replay(plan, damaged, env={**env, "NEFFBUILD_DOUBLE_LAYOUT": "flat"})
    by_id = {u.unit_id: u for u in elsewhere.units}
    assert by_id[eager.unit_id].compiles == 0 and not by_id[eager.unit_id].hit  # uncounted, yet seen
    assert all(re.fullmatch(r"[0-9a-f]+\.neff", w.path) for u in elsewhere.units for w in u.written)


def load_bundle(store, key: str):
    from neffbuild.documents.bundles import BundleRecord
    from neffbuild.documents.records import parse

    return parse(BundleRecord, store.get_doc("bundles", key), key)


def test_a_build_checks_the_lock_dir_and_compile_scratch_before_a_worker_starts(tmp_path, tiny_model):
    from neffbuild.build.compile import BuildOptions, build
    from neffbuild.errors import DiskError
    from neffbuild.fs.room import require_scratch
    from neffbuild.store import open_store

    dirs = NeuronBackend().scratch_dirs(
        tmp_path, {"TMPDIR": "/sys/kernel/neffbuild"}
    )  # sysfs: no new files, even for root
    assert dirs["the compile lock dir"] == tmp_path / "neuron-local" and Path("/tmp") in dirs.values()
    with pytest.raises(
        DiskError,
        match=r"^/sys/kernel/neffbuild \(neuronx-cc's scratch dir \(\$TMPDIR\)\): cannot create files in /sys/kernel",
    ):
        require_scratch(dirs, 0)
    with pytest.raises(DiskError, match=r"the compile lock dir\): only .* free on .*, a build needs"):
        require_scratch(NeuronBackend().scratch_dirs(tmp_path, {}), 1 << 60)
    require_scratch(NeuronBackend().scratch_dirs(tmp_path, {}), 1)

    (tmp_path / "tiny").symlink_to(tiny_model)
    path = tmp_path / "neffbuild.toml"
    path.write_text(E2E_MANIFEST)
    env = {**os.environ, **DOUBLE_ENV, "TMPDIR": "/sys/kernel/neffbuild"}
    report = build(
        make_plan(load_manifest(path), env),
        open_store(str(tmp_path / "store"), create=True),
        env=env,
        options=BuildOptions(logs_dir=tmp_path / "logs"),
    )
    assert [o.status for o in report.outcomes] == ["failed", "failed"]
    assert all(
        "cannot create files in /sys/kernel" in o.error and o.log is None for o in report.outcomes
    )  # no worker ran


# -- second reading against torch_neuronx 0.1.0 (issue 36) ---------------------------------------

DOCS = TESTS.parent / "docs" / "trainium.md"
TABLE_HEADING = "### Every variable TorchNeuron reads"


def variable_table() -> list[tuple[str, str, str]]:
    """(name, upstream files, treatment) per row of the docs table."""
    text = DOCS.read_text()
    assert TABLE_HEADING in text, "docs/trainium.md lost its variable table"
    rows = []
    for line in text.split(TABLE_HEADING, 1)[1].splitlines():
        if rows and not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows.append((cells[0].strip("`"), cells[1], cells[2]))
    return rows


def test_the_docs_table_of_torchneuron_variables_is_what_the_code_does(tmp_path):
    from neffbuild.servingenv import NEURON, NEURON_COMPILER, NEURON_OTHER_STACKS

    rows = variable_table()
    names = [n for n, _, _ in rows]
    assert len(names) == len(set(names)) and len(rows) >= 40
    # Every name the code lists (less OMP_NUM_THREADS and the other stacks' paths) has a row, and no other.
    listed = (NEURON_COMPILER | NEURON.host_only | {NEURON.cache_env}) - NEURON_OTHER_STACKS
    assert set(names) == listed
    backend = backend_on(tmp_path, package_dir=lambda name: fake_torch_neuronx(tmp_path / "site"))
    facts = backend.collect_facts({}, "neuron")
    unset = backend.fingerprint(facts, {}, entry())
    for name, where, treatment in rows:
        assert re.fullmatch(r"(`[\w/]+\.(py|cpp|h):[\d,]+`(; )?)+", where), (name, where)
        keyed = backend.fingerprint(facts, {name: "neffbuild-probe"}, entry()) != unset
        exported = NEURON.declares(name) or name == NEURON.cache_env
        assert (keyed, exported, NEURON.is_host_only(name)) == {
            "keyed + exported": (True, True, False),
            "exported": (False, True, False),
            "host-only": (False, False, True),
        }[treatment], name
    assert {n for n, _, t in rows if t == "host-only"} >= set(ISSUE_RUNTIME_ONLY)


def test_a_release_exports_only_what_shapes_the_artifact():
    from neffbuild.servingenv import NEURON

    assert not any(NEURON.declares(n) for n in ISSUE_RUNTIME_ONLY)
    assert not NEURON.declares("TORCH_NEURONX_SOMETHING_NEW")  # exact, not a prefix
    assert NEURON.declares("NEURON_CC_FLAGS") and NEURON.declares("TORCH_NEURONX_MLIR_ATEN_OPS")


def test_the_packages_that_write_the_hashed_hlo_are_keyed_and_a_host_with_another_is_a_mismatch(tmp_path):
    from neffbuild.documents.records import Release, ReleaseUnit
    from neffbuild.host.hostcheck import check_host

    def host(mlir: str | None, jax: str | None) -> NeuronBackend:
        modules = {"torch_mlir": mlir, "jax": jax}
        return backend_on(tmp_path, module_version=modules.get)

    builder = host("torch-mlir 20260101+neuron", "jax 0.6.2")
    built = builder.fingerprint(builder.collect_facts({}, "neuron"), {}, entry())
    assert built["torch-mlir"] == "torch-mlir 20260101+neuron" and built["jax"] == "jax 0.6.2"
    assert built["jaxlib"] == "absent"  # allowed: planning does not refuse it
    assert not {"torch-mlir", "jax", "jaxlib"} & set(builder.unusable_facts(builder.collect_facts({}, "neuron"), {}))
    release = Release(
        name="r", manifest_digest="0" * 32, backend="neuron", cache_env="TORCH_NEURONX_NEFF_CACHE_DIR", env={},
        fingerprint=built, units=(ReleaseUnit(unit_id="m/32x32x1", key="k" * 32),), files=(),
    )  # fmt: skip
    for other, field in (
        (host("torch-mlir 20260301+neuron", "jax 0.6.2"), "torch-mlir"),
        (host("torch-mlir 20260101+neuron", None), "jax"),
    ):
        report = check_host(release, {}, facts=lambda b, env, device, other=other: other.collect_facts(env, device))
        assert [d.name for d in report.breaking] == [field], report.breaking
    same = check_host(release, {}, facts=lambda b, env, device: builder.collect_facts(env, device))
    assert same.ok


def test_files_in_no_known_layout_are_named(tmp_path):
    backend = NeuronBackend()
    for rel in (
        "ab/cd/abcd" + "0" * 28 + ".neff",
        "ab/cd/.tmp.Xy12Qz",  # TorchNeuron's temp file: left by a crash, not a layout
        "a" * 64 + "/" + "a" * 64 + ".neff",
        "a" * 64 + "/tmpk2j4.tmp",
        "neuronxcc-2.21/MODULE_1+a/model.log",  # libneuronxla, a cached failure: known, not bundled
        ".neffbuild/state.json",  # pull's own
    ):
        touch(tmp_path, rel)
    assert backend.unrecognised_files(tmp_path) == []
    touch(tmp_path, "abcd" + "0" * 28 + ".neff")  # a third layout
    touch(tmp_path, "ab/cd/ffff" + "0" * 28 + ".neff")  # shard dirs that disagree with the key
    (tmp_path / "link.neff").symlink_to(tmp_path / "ab")
    assert backend.unrecognised_files(tmp_path) == [
        "ab/cd/ffff" + "0" * 28 + ".neff",
        "abcd" + "0" * 28 + ".neff",
        "link.neff",
    ]


def test_a_build_worker_turns_every_cpu_fallback_off_without_splitting_keys(tmp_path):
    env = NeuronBackend().worker_env(tmp_path / "cache", tmp_path)
    # Compiled graphs, the Python path's eager ops (python_ops/base.py:716) and the C++ path's (ErrorRecovery.cpp:20).
    assert env["TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"] == "1"
    assert env["TORCH_NEURONX_FALLBACK_ONLY_FOR_UNIMPLEMENTED_OPS"] == "1" and env["NEURON_FALLBACK_ENABLED"] == "0"


def test_python_requirements_are_read_as_pep_440_release_clauses():
    from neffbuild.backends.neuron_toolchain import python_excluded

    assert python_excluded(">=3.10,<3.11", (3, 11, 7)) and not python_excluded(">=3.10,<3.11", (3, 10, 14))
    assert python_excluded("==3.10.*", (3, 11, 0)) and not python_excluded("==3.11.*", (3, 11, 2))
    assert not python_excluded(">=3.10", (3, 12, 1)) and python_excluded("~=3.12", (3, 11, 9))
    assert not python_excluded("a clause nobody reads", (3, 11, 0))


def test_plan_refuses_a_torch_neuronx_whose_python_the_worker_cannot_run(tmp_path):
    package = fake_torch_neuronx(tmp_path / "site")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    too_new = f">=3.8,<{here}"  # 0.1.0 says ">=3.10,<3.11"; neffbuild needs >= 3.11
    backend = backend_on(tmp_path, package_dir=lambda name: package, requires_python=lambda d: too_new)
    problems = backend.check_host(entry(), {"PATH": os.defpath}, declared=False)
    assert len(problems) == 1 and f"requires Python {too_new}" in problems[0].message
    assert sys.executable in problems[0].message and "Releases and Pythons" in problems[0].hint
    fits = backend_on(tmp_path, package_dir=lambda name: package, requires_python=lambda d: f">={here}")
    assert all(
        "requires Python" not in p.message for p in fits.check_host(entry(), {"PATH": os.defpath}, declared=False)
    )
    assert backend.check_host(entry(), {}, declared=True) == []  # planning for another host


def _unit(id_: str, mode: str, env: str) -> str:
    return f"""
[[model]]
id = "{id_}"
model = "./tiny"
pipeline = "Flux2KleinPipeline"
dtype = "float32"
backend = "neuron"
device = "neuron"
mode = "{mode}"
shapes = {{ height = 32, width = 32 }}
call = {{ num_inference_steps = 1, max_sequence_length = 64, text_encoder_out_layers = [1] }}
env = {{ {env} }}
"""


# Upstream behaviours the double imitates (tests/neuron_double.py): a failed eager op that would
# run on CPU, a cache file in a layout the bundler does not know, and a wheel that caches elsewhere.
# One serving process has one environment: synchronous and asynchronous entries build apart.
REFUSED_SYNC = (
    'name = "tiny-neuron-refused-sync"\n'
    + _unit("fallback", "eager", 'NEURON_LAUNCH_BLOCKING = "1", NEFFBUILD_DOUBLE_FAIL_OP = "Linear"')
    + _unit("nowhere", "eager", 'NEURON_LAUNCH_BLOCKING = "1", NEFFBUILD_DOUBLE_LAYOUT = "none"')
)
REFUSED_ASYNC = (
    'name = "tiny-neuron-refused-async"\n'
    + _unit("fallbackasync", "eager", 'NEURON_LAUNCH_BLOCKING = "0", NEFFBUILD_DOUBLE_FAIL_OP = "Linear"')
    + _unit("third", "regional", 'NEURON_LAUNCH_BLOCKING = "0", NEFFBUILD_DOUBLE_LAYOUT = "flat"')
)


@pytest.mark.slow
def test_a_build_refuses_cpu_fallback_unknown_layouts_and_an_empty_eager_unit(tmp_path, tiny_model, cli):
    (tmp_path / "tiny").symlink_to(tiny_model)
    env = {**DOUBLE_ENV, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    store = tmp_path / "store"
    errors = {}
    for text in (REFUSED_SYNC, REFUSED_ASYNC):
        path = tmp_path / "neffbuild.toml"
        path.write_text(text)
        done = cli("build", str(path), "--store", str(store), "--json", env=env)
        assert done.returncode == 5, done.stderr
        for o in json.loads(done.stdout)["outcomes"]:
            errors[o["unit_id"].split("/")[0]] = (o["status"], o.get("error") or "")
    assert {u: s for u, (s, _) in errors.items()} == dict.fromkeys(
        ("fallback", "fallbackasync", "third", "nowhere"), "failed"
    ), errors
    # Synchronous (the Python path) and asynchronous (the C++ path): the op is named, not run on CPU.
    assert "Operation Linear failed to execute on Neuron" in errors["fallback"][1]
    assert "Operation Linear failed to execute on Neuron" in errors["fallbackasync"][1]
    third = errors["third"][1]
    assert re.search(
        r"the compiler wrote [0-9a-f]{32}\.neff \(and \d+ more\) in TORCH_NEURONX_NEFF_CACHE_DIR, in a layout the neuron backend does not bundle",
        third,
    ), third
    assert "wrote no cache files (mode eager" in errors["nowhere"][1]
    # Nothing published: no release, no tag, no bundle.
    assert not [
        p for p in store.rglob("*") if p.is_file() and p.parts[len(store.parts)] in ("releases", "tags", "bundles")
    ]


@pytest.mark.parametrize("field", ["torch-mlir", "jax"])
def test_status_names_a_torch_mlir_or_jax_that_differs_from_the_builds(tmp_path, cli, field):
    from neffbuild.backends.base import Scope
    from neffbuild.build.publish import move_tag, publish_bundle, publish_release
    from neffbuild.documents.bundles import BundleRecord, Timings
    from neffbuild.documents.records import FileEntry, Release, ReleaseUnit, unit_key
    from neffbuild.store import open_store
    from tests.storekit import write_files

    unit = {
        "model": {"synthetic": "0"}, "pipeline": "P", "dtype": "float32", "backend": "neuron", "device": "neuron",
        "mode": "full", "components": ["transformer"], "tensor_parallel": 1,
        "shape": {"height": 32, "width": 32, "batch": 1}, "call": {}, "env": {},
    }  # fmt: skip
    backend = NeuronBackend()  # this host's real facts, as `status` reads them in its own process
    here = backend.fingerprint(backend.collect_facts(os.environ, "neuron"), os.environ, Scope.of_unit(unit))
    assert here[field] == "absent"  # a field of every neuron key: this host has none
    built = {**here, field: f"{field} 9.9.9"}  # the build host had one
    (source,) = write_files(tmp_path / "src", {"ab/cd/abcd" + "0" * 28 + ".neff": 100})
    entry_ = FileEntry(
        path="ab/cd/abcd" + "0" * 28 + ".neff", size=source.size, digest=source.digest, blake3=source.blake3
    )
    record = BundleRecord(
        key=unit_key(unit, built), unit_id="m/32x32x1", unit=unit, backend="neuron", fingerprint=built,
        files=(entry_,), counters={}, timings=Timings(), created_at="2026-01-01T00:00:00+00:00", neffbuild_version="test",
    )  # fmt: skip
    store = open_store(str(tmp_path / "store"), create=True)
    publish_bundle(store, record, [source], jobs=1)
    release = Release(
        name="prod", manifest_digest="0" * 32, backend="neuron", cache_env="TORCH_NEURONX_NEFF_CACHE_DIR", env={},
        fingerprint=built, units=(ReleaseUnit(unit_id="m/32x32x1", key=record.key),), files=(entry_,),
    )  # fmt: skip
    move_tag(store, "prod", publish_release(store, release))
    cache = tmp_path / "cache"
    pulled = cli("pull", "prod", "--store", str(tmp_path / "store"), "--cache-dir", str(cache), "--no-host-check")
    assert pulled.returncode == 0, pulled.stderr
    done = cli("status", "--cache-dir", str(cache), "--json")
    report = json.loads(done.stdout)
    assert done.returncode == 12 and [u["state"] for u in report["units"]] == ["mismatch"], done.stdout
    assert [(c["name"], c["breaking"]) for c in report["units"][0]["changes"]] == [(field, True)]
