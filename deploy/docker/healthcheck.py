"""gRPC health probe for the specdec images (Docker HEALTHCHECK and k8s exec probes).

Asks grpc.health.v1.Health/Check for one service name and exits 0 only if the
answer is SERVING. Plaintext by default; with --tls-ca it speaks TLS (and mTLS
when --tls-cert/--tls-key are given too), which Kubernetes' native gRPC probes
cannot do. Kept dependency-free apart from grpcio + grpcio-health-checking,
which the `server` extra already installs.
"""

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _channel(args):
    if not args.tls_ca:
        return grpc.insecure_channel(args.addr)
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(args.tls_ca),
        private_key=_read(args.tls_key) if args.tls_key else None,
        certificate_chain=_read(args.tls_cert) if args.tls_cert else None,
    )
    # We dial 127.0.0.1 but the certificate names the Service: check that name instead.
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    return grpc.secure_channel(args.addr, creds, options=options)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--service", default="", help='health service name ("" = whole server)')
    p.add_argument("--timeout", type=float, default=4.0)
    p.add_argument("--tls-ca")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--server-name", help="expected name in the server certificate")
    args = p.parse_args(argv)

    try:
        with _channel(args) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
    except grpc.RpcError as e:
        print(f"unhealthy: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
