"""deploy/kubernetes: the kustomize base and its overlays, rendered (tests/kustomize.py), validated offline against
the Kubernetes schemas (kubernetes-validate, strict) and scanned by a policy checker (checkov), both from the
``.venv-deploy`` that ``make setup`` installs; and what a platform team relies on: probes on Triton's health
endpoints, the ports, Prometheus annotations, an HPA on a metric the server exports, the models volume, the target and
heads as arguments, the API key from a Secret, one GPU per replica in the GPU overlay, tenant-hashed routing."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.kustomize import render

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy" / "kubernetes"
TOOLS = Path(os.environ.get("SPEC_DECODE_DEPLOY_VENV", ROOT / ".venv-deploy")) / "bin"
FOLDERS = {"base": DEPLOY / "base", "gpu": DEPLOY / "overlays" / "gpu",
           "tenant-routing": DEPLOY / "overlays" / "tenant-routing"}
KUBERNETES = "1.30.0"  # validated against this release's schemas (kubernetes-validate bundles them)


def _write(docs: list[dict], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, d in enumerate(docs):
        path = folder / f"{i:02d}-{d['kind'].lower()}-{d['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(d, sort_keys=False))
        paths.append(path)
    return paths


def _by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("name", list(FOLDERS))
def test_every_manifest_validates_against_the_kubernetes_schemas(name, tmp_path):
    paths = _write(render(FOLDERS[name]), tmp_path)
    proc = subprocess.run([str(TOOLS / "kubernetes-validate"), "--strict", "-k", KUBERNETES, *map(str, paths)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(" passed for resource ") == len(paths), proc.stdout


@pytest.mark.parametrize("name", list(FOLDERS))
def test_the_policy_checker_finds_nothing_failed(name, tmp_path):
    """checkov's Kubernetes checks pass on the rendered manifests (no check is skipped)."""
    _write(render(FOLDERS[name]), tmp_path)
    proc = subprocess.run([str(TOOLS / "checkov"), "-d", str(tmp_path), "--framework", "kubernetes", "--output", "json",
                           "--compact"], capture_output=True, text=True, timeout=600)
    report = json.loads(proc.stdout) if proc.stdout.strip().startswith(("{", "[")) else None
    assert report is not None, proc.stdout[-2000:] + proc.stderr[-2000:]
    reports = report if isinstance(report, list) else [report]
    failed = [(c["check_id"], c["check_name"], c["resource"]) for r in reports
              for c in r.get("results", {}).get("failed_checks", [])]
    assert not failed, failed
    summary = [r["summary"] for r in reports]
    assert sum(x["passed"] for x in summary) > 50  # the checks ran
    assert sum(x["failed"] for x in summary) == 0 and sum(x["skipped"] for x in summary) == 0, summary


def test_the_server_deployment_is_what_platform_teams_expect():
    docs = render(FOLDERS["base"])
    (dep,) = _by_kind(docs, "Deployment")
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002, "openai": 9000}
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "8002"
    assert c["command"] == ["python3", "-m", "spec_decode.launcher"]
    assert "--model=$(MODEL)" in c["args"] and "--speculator=$(SPECULATOR)" in c["args"]
    # the API key from a Secret, mounted as a file the launcher reads (kept out of arguments and environment)
    key_arg = next(a for a in c["args"] if a.startswith("--api-key-file="))
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
    assert secrets == {"api-key": "spec-decode-api-key"}
    assert key_arg.split("=", 1)[1] == mounts["api-key"] + "/key"
    (pvc,) = _by_kind(docs, "PersistentVolumeClaim")
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [pvc["metadata"]["name"]]
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/models", "/dev/shm", "/tmp"}
    assert all(d["metadata"].get("namespace") == "spec-decode" for d in docs if d["kind"] != "Namespace")
    services = {s["metadata"]["name"]: {p["port"] for p in s["spec"]["ports"]} for s in _by_kind(docs, "Service")}
    assert services == {"spec-decode-triton": {8000, 8001, 8002}, "spec-decode-openai": {9000}}


def test_the_autoscaler_reads_a_metric_the_server_exports():
    (hpa,) = _by_kind(render(FOLDERS["base"]), "HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert name == "spec_decode_running_sequences"
    metrics_src = (ROOT / "backend_src" / "spec_decode" / "serving" / "generate.py").read_text()
    assert f'"{name}"' in metrics_src  # set by generate on every request's start and end
    assert name in (ROOT / "docs" / "metrics.md").read_text()


def test_the_gpu_overlay_gives_each_replica_one_gpu():
    (dep,) = _by_kind(render(FOLDERS["gpu"]), "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert "--device=cuda" in c["args"] and "--model=$(MODEL)" in c["args"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"  # the base's, kept


def test_tenant_routing_hashes_the_tenant_header_to_one_replica():
    docs = render(FOLDERS["tenant-routing"])
    (ing,) = _by_kind(docs, "Ingress")
    assert ing["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_x_tenant_id"
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] in {s["metadata"]["name"] for s in _by_kind(docs, "Service")}


def test_the_launcher_takes_the_deployment_s_arguments(tmp_path):
    """Every option the Deployment passes is one the launcher has (argparse refuses others before anything starts);
    an API key file it cannot read stops it, naming the file."""
    import sys

    (dep,) = _by_kind(render(FOLDERS["gpu"]), "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(MODEL)", "/no/model").replace("$(SPECULATOR)", "/no/head").replace(
        "/secrets/api-key/key", str(tmp_path / "missing-key")) for a in c["args"]]
    proc = subprocess.run([sys.executable, "-m", "spec_decode.launcher", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "unrecognized arguments" not in proc.stderr, proc.stderr
    assert f"--api-key-file {str(tmp_path / 'missing-key')!r}" in proc.stderr, proc.stderr
