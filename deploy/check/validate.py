"""Schema checks of deploy/: run by `cargo xtask deploy-check` in its own virtual environment.

Every Kubernetes manifest under deploy/kubernetes/ is checked against the Kubernetes JSON
schemas bundled by kubernetes-validate (strict: unknown fields fail), the ServiceMonitor
against servicemonitor.schema.json, and the HAMi values and the Volcano patch for the keys
their charts and DaemonSet define (HAMi chart v2.10.0 values.yaml; Volcano v1.12.0 static
manifest). Exits non-zero with one line per problem.
"""

import json
import pathlib
import sys

import jsonschema
import kubernetes_validate
import yaml

DEPLOY = pathlib.Path(__file__).resolve().parent.parent
KUBERNETES_VERSION = "1.29.0"  # the oldest release we promise to work on (still in every bundle)

problems = []


def check_manifest(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    if not docs:
        problems.append(f"{path}: no documents")
    for doc in docs:
        kind = doc.get("kind")
        where = f"{path}: {kind}/{doc.get('metadata', {}).get('name')}"
        if kind == "ServiceMonitor":
            schema = json.loads((DEPLOY / "check/servicemonitor.schema.json").read_text())
            for e in jsonschema.Draft202012Validator(schema).iter_errors(doc):
                problems.append(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.append(f"{where}: no schema: {e}")


def dig(doc, dotted):
    for key in dotted.split("."):
        if not isinstance(doc, dict) or key not in doc:
            return None
        doc = doc[key]
    return doc


def check_hami_values(path):
    doc = yaml.safe_load(path.read_text())
    # The keys HAMi's chart reads for the device-plugin image (charts/hami/values.yaml,
    # templates/_helpers.tpl "hami.devicePlugin.image").
    for key in ["devicePlugin.image.registry", "devicePlugin.image.repository",
                "devicePlugin.image.tag", "devicePlugin.image.pullPolicy"]:
        if not isinstance(dig(doc, key), str) or not dig(doc, key):
            problems.append(f"{path}: {key} must be a non-empty string")
    allowed = {"registry", "repository", "tag", "pullPolicy", "pullSecrets"}
    extra = set(dig(doc, "devicePlugin.image") or {}) - allowed
    if extra:
        problems.append(f"{path}: devicePlugin.image has keys the chart does not read: {sorted(extra)}")
    if set(doc) != {"devicePlugin"} or set(doc["devicePlugin"]) != {"image"}:
        problems.append(f"{path}: only devicePlugin.image is meant to change")


def check_volcano_patch(path):
    doc = yaml.safe_load(path.read_text())
    containers = dig(doc, "spec.template.spec.containers") or []
    names = [c.get("name") for c in containers]
    if names != ["volcano-device-plugin"]:
        problems.append(f"{path}: must patch exactly the container volcano-device-plugin, not {names}")
        return
    c = containers[0]
    cmd = dig(c, "lifecycle.postStart.exec.command") or []
    if "/k8s-vgpu/bin/vgpu-install-lib.sh /usr/local/vgpu" not in " ".join(cmd) or "cp -f" in " ".join(cmd):
        problems.append(f"{path}: postStart must run vgpu-install-lib.sh, never cp -f: {cmd}")
    if not isinstance(c.get("image"), str):
        problems.append(f"{path}: image missing")
    # The patch, merged into a minimal DaemonSet, must still be a valid DaemonSet.
    ds = {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "volcano-device-plugin", "namespace": "kube-system"},
        "spec": {"selector": {"matchLabels": {"name": "volcano-device-plugin"}},
                 "template": {"metadata": {"labels": {"name": "volcano-device-plugin"}},
                              "spec": {"containers": containers}}},
    }
    try:
        kubernetes_validate.validate(ds, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        problems.append(f"{path}: {'.'.join(map(str, e.path))}: {e.message}")


manifests = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
if not manifests:
    problems.append("no manifests under deploy/kubernetes")
for m in manifests:
    check_manifest(m)
check_hami_values(DEPLOY / "hami/values-vgpu.yaml")
check_volcano_patch(DEPLOY / "volcano/daemonset-patch.yaml")

for p in problems:
    print(f"deploy-check: {p}")
if problems:
    sys.exit(1)
print(f"deploy-check: {len(manifests)} manifests valid against Kubernetes {KUBERNETES_VERSION} "
      "(strict), ServiceMonitor schema, HAMi values and Volcano patch keys")
