#!/usr/bin/env bash
# The Kubernetes manifests in deploy/k8s/, checked offline (no cluster, no
# network): every document parses and validates against a JSON Schema subset
# of the Kubernetes API (tests/deploy/k8s_schema.json; unknown fields are
# errors, as with kubectl's strict validation), plus the semantic checks of
# tests/deploy/k8s_check.py (etcd rendezvous, /dev/shm, the job token
# Secret, volumes). Then the self-test: mutated copies (misspelt fields,
# wrong values, broken references) must each be rejected. Exit 77 (ctest:
# skipped) without Debian's python3-yaml and python3-jsonschema.
#
#   k8s_manifests_test.sh SOURCE_DIR
set -euo pipefail

src=$(realpath "$1")
# Debian's interpreter: the python3 first on PATH may be another one
# without Debian's modules.
py=/usr/bin/python3
if [[ ! -x $py ]] || ! "$py" -c 'import yaml, jsonschema' 2>/dev/null; then
  echo "SKIP: /usr/bin/python3 with yaml and jsonschema is needed (deploy/install-deps.sh installs python3-yaml and python3-jsonschema)"
  exit 77
fi
timeout 60 "$py" "$src/tests/deploy/k8s_check.py" --self-test "$src/deploy/k8s"
echo "PASS"
