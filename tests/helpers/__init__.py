"""What the tests share by name: polling, a free port, reading a Prometheus exposition, reading a
service's JSON log lines, and probing health and reflection. Pytest fixtures stay in tests/conftest.py
(pytest injects them); everything a test imports lives here or in this package's modules:

* `reference`: independent numpy reference implementations (sampling transform, chi-square);
* `archmodels`: tiny random-weight models of mainstream architectures.

The service launcher and the tiny Llama builder are bench.launch and bench.tinymodels: the demo
and the benchmarks start services the same way, and bench never imports tests."""
from __future__ import annotations

import json
import time

from bench.launch import free_port  # noqa: F401 - a port that was free a moment ago, for a service that must be told one


def wait_for(cond, timeout: float = 10.0) -> bool:
    """Polls cond() until it is true or the timeout passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in a Prometheus exposition (0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def json_log_lines(svc, **fields) -> list[dict]:
    """The lines a started service (bench.launch.Service) wrote to stderr that parse as JSON and
    carry every `fields` key with that value, in order."""
    out = []
    for line in list(svc.stderr):
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and all(d.get(k) == v for k, v in fields.items()):
            out.append(d)
    return out


def assert_health_and_reflection(channel, service_name: str) -> None:
    """Over `channel`: the standard health service answers SERVING for the server ("") and for
    `service_name`, and server reflection lists `service_name`."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for service in ("", service_name):
        r = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    (r,) = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    assert service_name in {s.name for s in r.list_services_response.service}
