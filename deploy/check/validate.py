"""Schema checks of deploy/: run by `cargo xtask deploy-check` in its own virtual environment.

Every Kubernetes manifest under deploy/kubernetes/ is checked against the Kubernetes JSON
schemas bundled by kubernetes-validate (strict: unknown fields fail), the Prometheus-Operator
resources (ServiceMonitor, PrometheusRule) against the schemas beside this file (each first
shown to refuse a misspelt field), the exporter DaemonSets and ServiceMonitors for what the
monitoring needs, and each Helm values file for the keys its chart reads (HAMi chart 2.10.0,
Volcano's vgpu device-plugin chart 1.12.0, HAMi's DRA driver chart 0.1.0, HAMi-DRA's chart
0.0.1). Exits non-zero with one line per problem.
"""

import copy
import json
import pathlib
import sys

import jsonschema
import kubernetes_validate
import yaml

DEPLOY = pathlib.Path(__file__).resolve().parent.parent
KUBERNETES_VERSION = "1.29.0"  # the oldest release we promise to work on (still in every bundle)

problems = []

# The Prometheus-Operator kinds: their schema, and where in a resource of ours a misspelt field
# must be refused (the API server would prune it silently).
OPERATOR_KINDS = {
    "ServiceMonitor": ("servicemonitor.schema.json", ["spec", "endpoints", 0]),
    "PrometheusRule": ("prometheusrule.schema.json", ["spec", "groups", 0, "rules", 0]),
}


def operator_schema_errors(doc):
    schema_file, typo_at = OPERATOR_KINDS[doc["kind"]]
    validator = jsonschema.Draft202012Validator(json.loads((DEPLOY / "check" / schema_file).read_text()))
    typo = copy.deepcopy(doc)
    target = typo
    for key in typo_at:
        target = target[key]
    target["honorLabel"] = True
    if not list(validator.iter_errors(typo)):
        return [f"{schema_file} accepts a misspelt field at {'.'.join(map(str, typo_at))}: fix the schema"]
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]


def check_manifest(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    if not docs:
        problems.append(f"{path}: no documents")
    for doc in docs:
        kind = doc.get("kind")
        where = f"{path}: {kind}/{doc.get('metadata', {}).get('name')}"
        if kind in OPERATOR_KINDS:
            problems.extend(f"{where}: {p}" for p in operator_schema_errors(doc))
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


# Where each exporter must run: where its device plugin runs. HAMi's chart puts the plugin on
# devicePlugin.nvidiaNodeSelector (gpu: "on", charts/hami/values.yaml v2.10.0); Volcano's
# DaemonSet (static manifest v1.12.0, chart templates/daemonset.yaml with its default
# nodeSelector {}) has no selector and these tolerations (key, effect; None = any). HAMi's DRA
# kubelet plugin has no selector, affinity or toleration by default, in the driver's chart
# 0.1.0 (kubeletPlugin.nodeSelector/affinity/tolerations empty) and in HAMi-DRA's 0.0.1 (none
# in its DaemonSet template).
EXPORTER_NODES = {
    "vgpu-exporter-hami.yaml": ({"gpu": "on"}, []),
    "vgpu-exporter-volcano.yaml": ({}, [("CriticalAddonsOnly", None), ("volcano.sh/gpu-memory", "NoSchedule")]),
    "vgpu-exporter-hami-dra.yaml": ({}, []),
}


def tolerates(tolerations, key, effect):
    """Whether an Exists toleration covers taint `key` (any value) with `effect` (None: every
    effect, as the plugin's own toleration without an effect does)."""
    def covers(t):
        effect_ok = t.get("effect") is None or (effect is not None and t["effect"] == effect)
        return t.get("operator") == "Exists" and t.get("key") in (None, key) and effect_ok
    return any(covers(t) for t in tolerations)


def check_monitoring(path):
    """What the monitoring needs of an exporter manifest (docs/kubernetes.md, "Monitoring")."""
    for doc in (d for d in yaml.safe_load_all(path.read_text()) if d):
        if doc["kind"] == "ServiceMonitor":
            for i, ep in enumerate(dig(doc, "spec.endpoints") or []):
                if ep.get("honorLabels") is not True:
                    problems.append(f"{path}: ServiceMonitor endpoint {i}: honorLabels must be true, "
                                    "or the Operator renames the tenants' namespace/pod/container labels")
        if doc["kind"] != "DaemonSet":
            continue
        pod = dig(doc, "spec.template.spec")
        for c in pod.get("containers", []):
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if env.get("NVIDIA_VISIBLE_DEVICES") != "void":
                problems.append(f"{path}: container {c['name']}: NVIDIA_VISIBLE_DEVICES must be void "
                                "(the image's base sets all: the NVIDIA runtime would hand it every GPU)")
        selector, taints = EXPORTER_NODES[path.name]
        if (pod.get("nodeSelector") or {}) != selector or pod.get("affinity"):
            problems.append(f"{path}: nodeSelector {pod.get('nodeSelector')} (affinity {pod.get('affinity')}): "
                            f"the device plugin runs on nodeSelector {selector}, no affinity")
        for key, effect in taints:
            if not tolerates(pod.get("tolerations") or [], key, effect):
                problems.append(f"{path}: does not tolerate {key}:{effect or '*'} as the device plugin does")


manifests = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
if not manifests:
    problems.append("no manifests under deploy/kubernetes")
for m in manifests:
    check_manifest(m)
for name in EXPORTER_NODES:
    check_monitoring(DEPLOY / "kubernetes" / name)
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
      "(strict), ServiceMonitor and PrometheusRule schemas, the exporters' monitoring needs, "
      "the values of the HAMi, Volcano, DRA driver and HAMi-DRA charts")
