"""The Kubernetes manifests as rendered (kubectl kustomize), read as an operator would: tokens
in Secret files, the network fences, where each model runs, threads against CPU limits, pinned
engine choices, connection recycling, and the monitoring and autoscaling resources against
the metrics the services really export. deploy/check.sh validates the same renders against
the Kubernetes and operator schemas. And what the images install: the package built from
pyproject.toml."""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import yaml

from bench.launch import ROOT

OVERLAYS = ["local-cpu", "gpu", "gpu-mtls"]
CPU_LIMIT = {"1": 1, "2": 2, "4": 4, "8": 8, "500m": 0.5, "250m": 0.25}


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("needs kubectl (deploy/check.sh renders and validates the overlays)")
    out = subprocess.run([kubectl, "kustomize", os.path.join(ROOT, "deploy", "k8s", "overlays", overlay)],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_name(docs):
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def config(docs) -> dict:
    """The settings of both tiers' ConfigMaps (their keys do not overlap)."""
    maps = [d["data"] for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith(("specdec-verify-config",
                                                                                                      "specdec-draft-config"))]
    assert len(maps) == 2 and not set(maps[0]) & set(maps[1])
    return {k: v for m in maps for k, v in m.items()}


def container(docs, name) -> dict:
    (c,) = by_name(docs)["Deployment", name]["spec"]["template"]["spec"]["containers"]
    return c


def config_env(c) -> dict:
    return {e["name"]: e["valueFrom"]["configMapKeyRef"]["key"] for e in c["env"] if "configMapKeyRef" in e.get("valueFrom", {})}


def resolve(value: str, c: dict, cfg: dict) -> str:
    """A container arg or env value with its $(VAR) references resolved as the kubelet does."""
    env = {e["name"]: e for e in c["env"]}

    def var(m):
        e = env[m.group(1)]
        if "value" in e:
            return resolve(e["value"], c, cfg)
        ref = e["valueFrom"].get("configMapKeyRef")
        return cfg[ref["key"]] if ref else m.group(0)  # a field reference: known only in the pod
    return re.sub(r"\$\((\w+)\)", var, value)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_keep_tokens_in_secret_files_and_fence_the_verify(overlay):
    docs = render(overlay)
    by = by_name(docs)
    for name in ("specdec-verify", "specdec-draft"):
        pod = by["Deployment", name]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        secret_dirs = {m["mountPath"] for m in c["volumeMounts"]
                       for v in pod["volumes"] if v["name"] == m["name"] and "secret" in v}
        token_args = [a for a in c["args"] if a.split("=")[0].endswith("-token-file")]
        assert token_args, name  # authentication is on
        for a in token_args:  # a file, mounted from a Secret
            assert os.path.dirname(a.split("=", 1)[1]) in secret_dirs, a
        assert not [a for a in c["args"] if a.split("=")[0].endswith("-token")], name  # never the token itself
        assert not [e for e in c.get("env", []) if e["name"].endswith("TOKEN") or "secretKeyRef" in e.get("valueFrom", {})], name
        assert not [e for e in c.get("envFrom", []) if "secretRef" in e], name
    verify_args = container(docs, "specdec-verify")["args"]
    assert ("--client-token-file=/etc/specdec/client-token/token" in verify_args) == (overlay != "local-cpu")
    scraper = {"matchLabels": {"specdec.io/metrics-scraper": "true"}}
    rules = by["NetworkPolicy", "specdec-verify"]["spec"]["ingress"]
    allowed = {(json.dumps(r["from"], sort_keys=True), r["ports"][0]["port"]) for r in rules}
    want = {(json.dumps([{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "specdec-draft"}}}]), "grpc"),
            # metrics: labelled scraper pods here, or any pod of a labelled (monitoring) namespace
            (json.dumps([{"podSelector": scraper}, {"namespaceSelector": scraper}], sort_keys=True), "metrics")}
    if overlay != "local-cpu":  # the fallback component admits the labelled clients
        want.add((json.dumps([{"podSelector": {"matchLabels": {"specdec.io/verify-client": "true"}}}]), "grpc"))
    assert allowed == want and all(len(r["ports"]) == 1 for r in rules)
    draft_rules = by["NetworkPolicy", "specdec-draft"]["spec"]["ingress"]
    # clients from anywhere, with the client token, over gRPC or the HTTP API
    assert {"ports": [{"port": "grpc", "protocol": "TCP"}, {"port": "http", "protocol": "TCP"}]} in draft_rules
    assert [r for r in draft_rules if r.get("ports", [{}])[0].get("port") == "metrics"][0]["from"] == \
        [{"podSelector": scraper}, {"namespaceSelector": scraper}]


@pytest.mark.parametrize("overlay,verify_device", [("local-cpu", "cpu"), ("gpu", "cuda"), ("gpu-mtls", "cuda")])
def test_manifests_place_each_model_and_pin_its_engine(overlay, verify_device):
    """--device/--dtype reach the services as SPECDEC_DEVICE / SPECDEC_DTYPE from the config map:
    the verify on its GPU in the GPU overlays (auto: the checkpoint's dtype), the drafts on the CPU
    everywhere, in float32, named. Every service on
    a CPU has its engine choices pinned (SPECDEC_ENGINE_CHOICES), so its replicas make the same
    ones; a GPU has none to pin."""
    docs = render(overlay)
    cfg = config(docs)
    for name, prefix, device in (("specdec-verify", "VERIFY", verify_device), ("specdec-draft", "DRAFT", "cpu")):
        env = config_env(container(docs, name))
        assert cfg[env["SPECDEC_DEVICE"]] == device and env["SPECDEC_DEVICE"] == f"{prefix}_DEVICE"
        assert cfg[env["SPECDEC_DTYPE"]] == ("auto" if device == "cuda" else "float32"), name  # the CPU's dtype named: replicas alike
        assert env["SPECDEC_ENGINE_CHOICES"] == f"{prefix}_ENGINE_CHOICES"
        choices = cfg[env["SPECDEC_ENGINE_CHOICES"]]
        assert (choices == "") == (device == "cuda"), (name, choices)
        if choices:
            from specdec.choices import parse_choices  # the services' own parser: the pin must start
            assert parse_choices(choices) == {"fp32_prepack": False, "per_row": True, "row_kernel": True, "attention_kernel": True}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_match_threads_to_cpu_limits_and_recycle_client_connections(overlay):
    docs = render(overlay)
    cfg = config(docs)
    for name in ("specdec-verify", "specdec-draft"):
        c = container(docs, name)
        args = dict(a.split("=", 1) for a in (resolve(a, c, cfg) for a in c["args"]) if "=" in a)
        omp = resolve(next(e["value"] for e in c["env"] if e["name"] == "OMP_NUM_THREADS"), c, cfg)
        limit = CPU_LIMIT[c["resources"]["limits"]["cpu"]]
        assert int(args["--threads"]) == int(omp) == limit, (name, args["--threads"], omp, limit)
        if overlay != "local-cpu":  # production: threads past the CPUs a busy node gives it slow each step (local-cpu fits a laptop)
            assert CPU_LIMIT[c["resources"]["requests"]["cpu"]] == limit, (name, c["resources"])
    draft_args = [resolve(a, container(docs, "specdec-draft"), cfg) for a in container(docs, "specdec-draft")["args"]]
    age = [float(a.split("=", 1)[1]) for a in draft_args if a.startswith("--max-connection-age-s=")]
    assert age and 0 < age[0] <= 600  # long-lived client channels move to new draft pods within minutes


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_flag_and_setting_the_pods_get_is_one_the_services_accept(overlay, monkeypatch):
    """Each container's args, its $(VAR)s resolved from the ConfigMap as the kubelet does, and its
    SPECDEC_* environment (the flags' defaults) go through the service's own argument parser: a
    value it refuses (as `VERIFY_MAX_CACHED_TOKENS=auto` was once) would be a pod that exits 2 at
    start-up in a cluster, found only there."""
    from draft_service.__main__ import parser as draft_parser
    from verify_service.__main__ import parser as verify_parser

    docs = render(overlay)
    cfg = config(docs)
    for name, parser, module in (("specdec-verify", verify_parser, "verify_service"), ("specdec-draft", draft_parser, "draft_service")):
        c = container(docs, name)
        assert c["command"] == ["python", "-m", module], name
        for e in c["env"]:
            if e["name"].startswith("SPECDEC_"):
                value = resolve(e["value"], c, cfg) if "value" in e else cfg.get(e["valueFrom"].get("configMapKeyRef", {}).get("key"))
                if value is not None:
                    monkeypatch.setenv(e["name"], value)
        fields = {"POD_NAMESPACE": by_name(docs)["Deployment", name]["metadata"].get("namespace", "default")}  # known in the pod
        args = [re.sub(r"\$\((\w+)\)", lambda m: fields[m.group(1)], resolve(a, c, cfg)) for a in c["args"]]
        parsed = parser().parse_args(args)  # exits 2 with the reason on stderr where it refuses one
        assert parsed.model == "/models" and parsed.port == 50051, name
        for e in c["env"]:
            monkeypatch.delenv(e["name"], raising=False)


def exported_metrics() -> set[str]:
    """The names the services' Prometheus registry exposes (histogram and counter suffixes included)."""
    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}
    out = subprocess.run([sys.executable, "-c", "import specdec.metrics, prometheus_client as p; "
                          "print('\\n'.join(f'{m.name} {m.type}' for m in p.REGISTRY.collect()))"],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=120).stdout.splitlines()
    return {name + s for name, kind in (line.split() for line in out) if name.startswith("specdec_") for s in suffixes[kind]}


def test_the_readmes_own_overlay_recipe_points_the_pods_at_your_images(tmp_path):
    """deploy/README.md's recipe (an overlay on ../gpu, then `kustomize edit set image OLD=NEW`),
    its image lines applied as that command writes them: every pod then pulls the new images."""
    with open(os.path.join(ROOT, "deploy", "README.md")) as f:
        edits = re.findall(r"^\s*(\S+)=(\S+):(\S+?)(?: \\)?$", f.read().split("kustomize edit set image", 1)[1].split("```", 1)[0], re.M)
    assert len(edits) == 2, edits
    # the names the recipe replaces, with images of the test's own (the recipe's placeholders may match the overlay's)
    edits = [(old, "registry.test/mine/" + new.rsplit("/", 1)[-1], "9.9.9") for old, new, _ in edits]
    images = "".join(f"  - name: {old}\n    newName: {new}\n    newTag: {tag}\n" for old, new, tag in edits)
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("needs kubectl")
    # the recipe's overlay sits beside ../gpu: here in a copy of the tree, not in the source tree (where deploy/check.sh,
    # which renders every overlay, could meet it half written; kustomize takes no absolute path to a base)
    shutil.copytree(os.path.join(ROOT, "deploy", "k8s"), tmp_path / "k8s")
    prod = tmp_path / "k8s" / "overlays" / "prod"
    prod.mkdir()
    (prod / "kustomization.yaml").write_text(f"apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
                                             f"resources:\n  - ../gpu\nimages:\n{images}")
    out = subprocess.run([kubectl, "kustomize", str(prod)], capture_output=True, text=True, check=True, timeout=120).stdout
    pulled = {c["image"] for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert pulled == {f"{new}:{tag}" for _, new, tag in edits}, pulled


def monitor_job(by) -> str:
    """The job label Prometheus Operator gives the PodMonitor's targets: its namespace/name."""
    meta = by["PodMonitor", "specdec"]["metadata"]
    return f"{meta['namespace']}/{meta['name']}"


def test_monitoring_and_autoscaling_use_exported_metrics():
    """The gpu overlay's PodMonitor, alert rules, dashboard and KEDA triggers query only metrics
    the services export, in the overlay's own namespace; the CPU-based draft HPA is gone and KEDA
    owns both tiers' replica counts."""
    docs = render("gpu")
    by = by_name(docs)
    ns = by["Deployment", "specdec-verify"]["metadata"]["namespace"]
    known = exported_metrics()
    assert {"specdec_verify_forward_seconds_sum", "specdec_live_sessions"} <= known
    rules = by["PrometheusRule", "specdec"]["spec"]["groups"]
    recorded = {r["record"] for g in rules for r in g["rules"] if "record" in r}
    alerts = {r["alert"] for g in rules for r in g["rules"] if "alert" in r}
    assert {"SpecdecVerifySaturated", "SpecdecErrors", "SpecdecAcceptanceCollapse"} <= alerts
    dashboard = json.loads(by["ConfigMap", "specdec-dashboard"]["data"]["dashboard.json"])
    queries = [r["expr"] for g in rules for r in g["rules"]]
    queries += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    scaled = {n: d for (k, n), d in by.items() if k == "ScaledObject"}
    assert set(scaled) == {"specdec-draft", "specdec-verify"}
    for name, so in scaled.items():
        assert so["spec"]["scaleTargetRef"]["name"] == name and so["metadata"]["namespace"] == ns
        for t in so["spec"]["triggers"]:
            assert t["type"] == "prometheus" and f'namespace="{ns}"' in t["metadata"]["query"], t
            queries.append(t["metadata"]["query"])
    assert len(queries) > 20
    job = f'job="{monitor_job(by)}"'
    for q in queries:
        # each raw series read from the PodMonitor's scrape only (from a review: where Prometheus also scrapes the pods'
        # prometheus.io annotations, every series is there twice, and a sum or rate against a fixed threshold counts double)
        raw = re.findall(r"\bspecdec_[a-z0-9_]+(\{[^}]*\})?", q)
        assert all(job in sel for sel in raw), q
        names = set(re.findall(r"\bspecdec[_:][a-z0-9_:]+", q))
        assert names or "up{" in q, q  # every query reads the services' metrics (or the scrape's own `up`)
        assert names <= known | recorded, (q, names - known - recorded)
    # only verify pods export the verify tier's unlabelled series (specdec/metrics.py VERIFY_ONLY); a per-pod view
    # or average of them still selects the verify pods, so it holds wherever a draft exported them too (the
    # saturation alert once averaged 2 busy verify pods with 2 idle drafts, and could not reach its 0.9)
    verify_only = re.compile(r"\bspecdec_(verify_[a-z_]+|reserved_tokens|cache_budget_tokens)\b")
    for q in queries:
        if verify_only.search(q) and re.search(r"by \([^)]*\bpod\b", q):
            assert 'app="specdec-verify"' in q, q
    assert ("HorizontalPodAutoscaler", "specdec-draft") not in by  # no CPU-based scaling of the draft
    assert "replicas" not in by["Deployment", "specdec-verify"]["spec"]  # KEDA's HPA owns it
    monitor = by["PodMonitor", "specdec"]["spec"]
    assert monitor["selector"]["matchLabels"] == {"app.kubernetes.io/part-of": "specdec"}
    ports = {p["name"] for d in ("specdec-verify", "specdec-draft") for p in container(docs, d)["ports"]}
    assert {e["port"] for e in monitor["podMetricsEndpoints"]} <= ports


def test_custom_resource_check_catches_unknown_and_mistyped_fields(tmp_path):
    """deploy/crds.py (run by deploy/check.sh) passes the rendered custom resources and fails a
    misspelt field or a wrong type, naming it."""
    docs = render("gpu")
    src, core = tmp_path / "in.yaml", tmp_path / "core.yaml"
    crds = [sys.executable, os.path.join(ROOT, "deploy", "crds.py"), str(src), str(core)]
    src.write_text(yaml.safe_dump_all(docs))
    ok = subprocess.run(crds, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "4 custom resources valid" in ok.stdout
    assert {d["kind"] for d in yaml.safe_load_all(core.read_text())} >= {"Deployment", "NetworkPolicy"}
    assert not {d["kind"] for d in yaml.safe_load_all(core.read_text())} & {"ScaledObject", "PodMonitor", "PrometheusRule"}
    for mutate, error in ((lambda so: so["spec"].__setitem__("minReplicas", 2), "unknown field spec.minReplicas"),
                          (lambda so: so["spec"].__setitem__("maxReplicaCount", "many"), "spec.maxReplicaCount"),
                          # from a review: pydantic's lax mode took "2" for 2, which the API server refuses
                          (lambda so: so["spec"].__setitem__("minReplicaCount", "2"), "spec.minReplicaCount")):
        bad = [dict(d) for d in docs]
        so = next(d for d in bad if d["kind"] == "ScaledObject")
        so["spec"] = dict(so["spec"])
        mutate(so)
        src.write_text(yaml.safe_dump_all(bad))
        r = subprocess.run(crds, capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and error in r.stderr, r.stderr
    # from a review: an unquoted date (YAML's timestamp) was a traceback; Kubernetes reads it as a string
    dated = [dict(d) for d in docs]
    so = next(d for d in dated if d["kind"] == "ScaledObject")
    so["metadata"] = dict(so["metadata"], annotations={"changed": datetime.date(2024, 1, 1)})
    src.write_text(yaml.safe_dump_all(dated))
    assert "changed: 2024-01-01\n" in src.read_text()
    r = subprocess.run(crds, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_the_installed_package_holds_every_module_the_services_import(tmp_path):
    """What the images install (`pip install /src[server]`, deploy/docker/*.Dockerfile) is a wheel
    built from pyproject.toml's package list, not the checkout: every module of specdec (its engine
    and CPU tier included, with its kernels' C sources), the client (as specdec.client) and both
    services must be in it."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "specdec", "client", "draft_service", "verify_service"):
        (shutil.copytree if os.path.isdir(os.path.join(ROOT, name)) else shutil.copy)(os.path.join(ROOT, name), src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "out"), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "out").glob("*.whl")
    have = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    want = set()
    for top, installed in (("specdec", "specdec"), ("client", "specdec/client"), ("draft_service", "draft_service"),
                           ("verify_service", "verify_service")):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            rel = os.path.relpath(d, os.path.join(ROOT, top))
            want |= {os.path.normpath(os.path.join(installed, rel, f)).replace(os.sep, "/") for f in files if f.endswith(".py")}
    assert "specdec/engine/forward.py" in want and "specdec/engine/cpu/rows.py" in want
    assert not want - have, f"not installed: {sorted(want - have)}"
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"specdec/engine/cpu/rowkernel.c", "specdec/engine/cpu/attend.c"} <= names  # the CPU tier's kernels' sources


def test_a_connection_past_its_max_age_lets_its_streams_finish_unless_a_grace_is_set():
    """--max-connection-age-s recycles connections (no new streams on an old one); its grace was
    --drain-s, so a draft's client stream still running 105 s past its connection's 5 minutes was
    cut with UNAVAILABLE after tokens had gone out. Now running streams end on their own unless
    --max-connection-age-grace-s bounds them."""
    from specdec import serving
    from verify_service.__main__ import parser

    def options(*flags):
        return dict(serving.server_options(parser().parse_args(["--model", "m", *flags])))

    aged = options("--max-connection-age-s", "300", "--drain-s", "105")
    assert aged["grpc.max_connection_age_ms"] == 300_000 and "grpc.max_connection_age_grace_ms" not in aged
    bounded = options("--max-connection-age-s", "300", "--max-connection-age-grace-s", "600")
    assert bounded["grpc.max_connection_age_grace_ms"] == 600_000
    assert "grpc.max_connection_age_ms" not in options()
    r = subprocess.run([sys.executable, "-m", "verify_service", "--model", "m", "--max-connection-age-grace-s", "5"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--max-connection-age-grace-s bounds streams" in r.stderr, r.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rollouts_outwait_model_loads_and_disruption_budgets_do_not_block_drains(overlay):
    """A Deployment whose pods may take their whole startup-probe budget to load a model has a
    progress deadline above it (the default 600 s failed a gpu rollout whose verify loaded for
    11 minutes); the disruption budgets evict unready pods (drafts are unready while no verify
    replica answers, which blocked every node drain)."""
    docs = render(overlay)

    def budget(name):
        probe = container(docs, name)["startupProbe"]
        return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3) + probe.get("initialDelaySeconds", 0)

    for name in ("specdec-verify", "specdec-draft"):
        d = by_name(docs)["Deployment", name]
        assert d["spec"].get("progressDeadlineSeconds", 600) > budget(name), (name, budget(name))
    # a draft is not ready until a verify replica answers: on a fresh install it waits for the verify's load too
    draft = by_name(docs)["Deployment", "specdec-draft"]
    assert draft["spec"].get("progressDeadlineSeconds", 600) > budget("specdec-verify"), overlay
    for d in docs:
        if d["kind"] == "PodDisruptionBudget":
            assert d["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow", d["metadata"]["name"]
