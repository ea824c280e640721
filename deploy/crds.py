"""Strict offline validation of the custom resources in rendered manifests (KEDA, Prometheus
Operator), which kubernetes-validate has no schemas for.

    python deploy/crds.py RENDERED.yaml CORE_OUT.yaml

Each custom resource is validated against the cloudcoil models generated from its operator's
CRD schemas (pydantic: types, required fields, enums); a field the schema does not know is an
error too (the model would drop it: its dump is compared with the input). The other documents
are written to CORE_OUT.yaml for kubernetes-validate. Exits 1 naming each error.
"""
from __future__ import annotations

import json
import sys

import yaml
from pydantic import ValidationError


def _models() -> dict[tuple[str, str], type]:
    from cloudcoil.models.keda import v1alpha1 as keda  # noqa: PLC0415
    from cloudcoil.models.prometheus_operator import v1 as prom  # noqa: PLC0415

    return {("keda.sh/v1alpha1", "ScaledObject"): keda.ScaledObject,
            ("monitoring.coreos.com/v1", "PodMonitor"): prom.PodMonitor,
            ("monitoring.coreos.com/v1", "ServiceMonitor"): prom.ServiceMonitor,
            ("monitoring.coreos.com/v1", "PrometheusRule"): prom.PrometheusRule}


def unknown_fields(given, kept, path: str = "") -> list[str]:
    """Paths present in `given` but not in `kept` (the model's dump of it)."""
    if isinstance(given, dict):
        kept = kept if isinstance(kept, dict) else {}
        return [p for k, v in given.items()
                for p in ([f"{path}.{k}"] if k not in kept else unknown_fields(v, kept[k], f"{path}.{k}"))]
    if isinstance(given, list):
        kept = kept if isinstance(kept, list) else []
        return [p for i, v in enumerate(given) for p in unknown_fields(v, kept[i] if i < len(kept) else None, f"{path}[{i}]")]
    return []


def check(doc: dict, model: type) -> list[str]:
    name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    try:
        # JSON's types as written: "2" is no integer; a YAML date (an unquoted 2024-01-01) a string, as Kubernetes reads it
        obj = model.model_validate_json(json.dumps(doc, default=str), strict=True)
    except ValidationError as e:
        return [f"{name}: {'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
    kept = obj.model_dump(by_alias=True, exclude_unset=True, mode="json")
    return [f"{name}: unknown field {p.lstrip('.')}" for p in unknown_fields(doc, kept)]


def main(src: str, core_out: str) -> int:
    models = _models()
    with open(src) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    errors, core, custom = [], [], 0
    for doc in docs:
        model = models.get((doc.get("apiVersion"), doc.get("kind")))
        if model is None:
            core.append(doc)
        else:
            custom += 1
            errors += check(doc, model)
    with open(core_out, "w") as f:
        yaml.safe_dump_all(core, f, sort_keys=False)
    for e in errors:
        print(f"ERROR {e}", file=sys.stderr)
    if not errors and custom:
        print(f"ok: {custom} custom resources valid against their operators' schemas (strict)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
