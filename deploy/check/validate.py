"""Schema checks of deploy/: run by `cargo xtask deploy-check` in its own virtual environment.

Every Kubernetes manifest under deploy/kubernetes/ is checked against the Kubernetes JSON
schemas bundled by kubernetes-validate (strict: unknown fields fail), the ServiceMonitor
against servicemonitor.schema.json, and each Helm values file for the keys its chart reads
(HAMi chart 2.10.0, Volcano's vgpu device-plugin chart 1.12.0, HAMi's DRA driver chart 0.1.0,
HAMi-DRA's chart 0.0.1). Exits non-zero with one line per problem.
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


def check_image_values(path, prefix, keys, chart):
    """Values that change only the image at `prefix` (dotted) of `chart`, with exactly the
    keys its templates read there."""
    doc = yaml.safe_load(path.read_text())
    image = dig(doc, prefix)
    if not isinstance(image, dict):
        problems.append(f"{path}: {prefix} missing")
        return
    for key in keys["required"]:
        if not isinstance(image.get(key), str) or not image.get(key):
            problems.append(f"{path}: {prefix}.{key} must be a non-empty string")
    extra = set(image) - set(keys["required"]) - set(keys.get("optional", []))
    if extra:
        problems.append(f"{path}: {prefix} has keys {chart} does not read: {sorted(extra)}")
    # Nothing else: the rest of the release's values stay as they are (--reuse-values).
    top = prefix.split(".")
    node = doc
    for i, key in enumerate(top):
        if not isinstance(node, dict) or set(node) != {key}:
            problems.append(f"{path}: only {prefix} is meant to change, found {sorted(node)} at "
                            f"{'.'.join(top[:i]) or 'the top'}")
            return
        node = node[key]


manifests = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
if not manifests:
    problems.append("no manifests under deploy/kubernetes")
for m in manifests:
    check_manifest(m)
check_hami_values(DEPLOY / "hami/values-vgpu.yaml")
# Volcano's chart 1.12.0 (templates/daemonset.yaml): "{{ .Values.image.repository }}:{{
# .Values.image.tag }}" and .Values.image.pullPolicy.
check_image_values(DEPLOY / "volcano/values-vgpu.yaml", "image",
                   {"required": ["repository", "tag", "pullPolicy"]}, "Volcano's chart 1.12.0")
# HAMi's DRA driver chart 0.1.0 (templates/_helpers.tpl "hami-dra-driver.fullimage": repository
# and tag, the tag defaulting to appVersion; daemonset.yaml: .Values.image.pullPolicy).
check_image_values(DEPLOY / "hami-dra/values-vgpu.yaml", "image",
                   {"required": ["repository", "tag", "pullPolicy"]}, "the DRA driver's chart 0.1.0")
# HAMi-DRA's chart 0.0.1 (_commons.tpl "common.images.image": registry, repository, tag, the
# registry replaced by global.imageRegistry when set; pullPolicy, pullSecrets).
check_image_values(DEPLOY / "hami-dra/values-vgpu-hami-dra.yaml", "drivers.nvidia.image",
                   {"required": ["registry", "repository", "tag", "pullPolicy"],
                    "optional": ["pullSecrets"]}, "HAMi-DRA's chart 0.0.1")

for p in problems:
    print(f"deploy-check: {p}")
if problems:
    sys.exit(1)
print(f"deploy-check: {len(manifests)} manifests valid against Kubernetes {KUBERNETES_VERSION} "
      "(strict), ServiceMonitor schema, the values of the HAMi, Volcano, DRA driver and HAMi-DRA "
      "charts")
