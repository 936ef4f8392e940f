#!/usr/bin/python3
"""Offline check of the Kubernetes manifests in deploy/k8s/.

  k8s_check.py MANIFEST_DIR            check the manifests; exit 1 on errors
  k8s_check.py --self-test MANIFEST_DIR
      check them, then check mutated copies (a misspelt field, a wrong
      value, a broken reference) and fail unless every mutant is rejected

Two parts:
  * schema: every document parses (PyYAML) and validates against
    k8s_schema.json (next to this file), a JSON Schema subset of the
    Kubernetes API for the kinds and fields the manifests use, with
    additionalProperties false wherever the API server rejects unknown
    fields; checked with Debian's python3-jsonschema;
  * semantics: what the API server cannot see but the job needs: the Job
    runs elastic-run with --rdzv-backend etcd and an --rdzv-endpoint that
    names the etcd Service and its client port, --nnodes MIN:MAX fits the
    Job's parallelism, a Memory emptyDir is mounted at /dev/shm with a
    sizeLimit, TRELLIS_JOB_TOKEN comes from a Secret key that exists, every
    mount, claim and Secret reference resolves, the checkpoint dir is on a
    mounted volume, the etcd Service selects the StatefulSet's pods.

Runs with /usr/bin/python3 (Debian's python3-yaml and python3-jsonschema).
"""
import copy
import glob
import json
import os
import re
import sys

import jsonschema
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))


def load(manifest_dir):
    """[(file, index, doc)] for every YAML document under manifest_dir."""
    docs = []
    for path in sorted(glob.glob(os.path.join(manifest_dir, "*.yaml"))):
        with open(path) as f:
            text = f.read()
        docs.extend(parse(os.path.basename(path), text))
    return docs


def parse(name, text):
    return [(name, i, d) for i, d in enumerate(yaml.safe_load_all(text)) if d is not None]


def schema_errors(docs, schema):
    validator = jsonschema.Draft7Validator(schema)
    errors = []
    for name, i, doc in docs:
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(e.path)):
            where = "/".join(str(p) for p in e.absolute_path) or "(top)"
            errors.append(f"{name}[{i}] {doc.get('kind', '?')}: {where}: {e.message}")
    return errors


def flag(argv, name):
    """The value after `name` in argv (or of `name=value`), else None."""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a[len(name) + 1:]
    return None


def semantic_errors(docs):
    errors = []
    by_kind = {}
    for name, i, doc in docs:
        by_kind.setdefault(doc.get("kind"), []).append((name, doc))

    def named(kind, n):
        return [d for _, d in by_kind.get(kind, []) if d.get("metadata", {}).get("name") == n]

    services = by_kind.get("Service", [])
    secrets = {d["metadata"]["name"]: d for _, d in by_kind.get("Secret", [])}
    claims = {d["metadata"]["name"] for _, d in by_kind.get("PersistentVolumeClaim", [])}

    # etcd: a StatefulSet whose serviceName is a Service selecting its pods.
    for name, sts in by_kind.get("StatefulSet", []):
        spec = sts.get("spec", {})
        tmpl_labels = spec.get("template", {}).get("metadata", {}).get("labels", {})
        sel = spec.get("selector", {}).get("matchLabels", {})
        if any(tmpl_labels.get(k) != v for k, v in sel.items()):
            errors.append(f"{name}: StatefulSet {sts['metadata']['name']}: selector {sel} does not match the pod labels {tmpl_labels}")
        svc = named("Service", spec.get("serviceName"))
        if not svc:
            errors.append(f"{name}: StatefulSet serviceName '{spec.get('serviceName')}' is no Service here")
        for s in svc:
            ssel = s.get("spec", {}).get("selector", {})
            if not ssel or any(tmpl_labels.get(k) != v for k, v in ssel.items()):
                errors.append(f"{name}: Service {s['metadata']['name']} selects {ssel}, not the pods of StatefulSet {sts['metadata']['name']} ({tmpl_labels})")

    jobs = by_kind.get("Job", [])
    if not jobs:
        errors.append("no Job among the manifests")
    for name, job in jobs:
        jname = job.get("metadata", {}).get("name")
        spec = job.get("spec", {})
        pod = spec.get("template", {}).get("spec", {})
        volumes = {v.get("name"): v for v in pod.get("volumes", [])}
        for v in volumes.values():
            pvc = v.get("persistentVolumeClaim")
            if pvc and pvc.get("claimName") not in claims:
                errors.append(f"{name}: volume '{v['name']}' claims '{pvc.get('claimName')}', which is no PersistentVolumeClaim here")
        runs = [c for c in pod.get("containers", []) if "elastic-run" in (c.get("command", []) + c.get("args", []))]
        if not runs:
            errors.append(f"{name}: Job {jname}: no container runs elastic-run")
        for c in runs:
            argv = c.get("command", []) + c.get("args", [])
            argv = argv[argv.index("elastic-run"):]
            where = f"{name}: Job {jname} container {c.get('name')}"
            if flag(argv, "--rdzv-backend") != "etcd":
                errors.append(f"{where}: --rdzv-backend is '{flag(argv, '--rdzv-backend')}', not etcd")
            endpoint = flag(argv, "--rdzv-endpoint") or ""
            m = re.fullmatch(r"([a-z0-9.-]+)(?::(\d+))?", endpoint)
            if not m:
                errors.append(f"{where}: --rdzv-endpoint '{endpoint}' is not HOST[:PORT]")
            else:
                host, port = m.group(1), int(m.group(2) or 2379)
                svc = [d for _, d in services if d["metadata"]["name"] == host.split(".")[0]]
                if not svc:
                    errors.append(f"{where}: --rdzv-endpoint host '{host}' names no Service here (etcd's is {[d['metadata']['name'] for _, d in services]})")
                elif port not in [p.get("port") for p in svc[0]["spec"].get("ports", [])]:
                    errors.append(f"{where}: --rdzv-endpoint port {port} is not a port of Service {host}")
                else:
                    sel = svc[0]["spec"].get("selector", {})
                    if not any(all(d.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {}).get(k) == v for k, v in sel.items())
                               and "etcd" in " ".join(x.get("image", "") for x in d["spec"]["template"]["spec"]["containers"])
                               for _, d in by_kind.get("StatefulSet", [])):
                        errors.append(f"{where}: Service {host} does not select an etcd StatefulSet's pods")
            if not flag(argv, "--rdzv-id"):
                errors.append(f"{where}: no --rdzv-id")
            nnodes = flag(argv, "--nnodes") or ""
            m = re.fullmatch(r"(\d+)(?::(\d+))?", nnodes)
            if not m:
                errors.append(f"{where}: --nnodes '{nnodes}' is not MIN:MAX")
            else:
                lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
                if not 1 <= lo <= hi:
                    errors.append(f"{where}: --nnodes {nnodes}: need 1 <= MIN <= MAX")
                if spec.get("parallelism", 1) != hi or spec.get("completions", 1) != hi:
                    errors.append(f"{where}: --nnodes MAX {hi} but the Job's parallelism/completions are {spec.get('parallelism')}/{spec.get('completions')}")
            if spec.get("completionMode") != "Indexed":
                errors.append(f"{where}: the Job is not Indexed")
            if not (flag(argv, "--nproc-per-node") or "").isdigit():
                errors.append(f"{where}: --nproc-per-node is not a number")
            # $(VAR) in args must be a variable of the container.
            env = {e.get("name"): e for e in c.get("env", [])}
            for a in argv:
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", a):
                    if var not in env:
                        errors.append(f"{where}: argument '{a}' uses $({var}), which the container does not define")
            # The job token from a Secret key that exists.
            tok = env.get("TRELLIS_JOB_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef")
            if not tok:
                errors.append(f"{where}: TRELLIS_JOB_TOKEN does not come from a Secret (secretKeyRef)")
            for e in env.values():
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    s = secrets.get(ref.get("name"))
                    keys = set((s or {}).get("data", {}) or {}) | set((s or {}).get("stringData", {}) or {})
                    if s is None:
                        errors.append(f"{where}: env {e['name']} refers to Secret '{ref.get('name')}', which is not here")
                    elif ref.get("key") not in keys:
                        errors.append(f"{where}: env {e['name']} refers to key '{ref.get('key')}' of Secret {ref.get('name')}, which has {sorted(keys)}")
            # Mounts: every one names a volume; /dev/shm is a Memory emptyDir with a limit.
            mounts = {m.get("mountPath"): m for m in c.get("volumeMounts", [])}
            for m in mounts.values():
                if m.get("name") not in volumes:
                    errors.append(f"{where}: mount {m.get('mountPath')} names volume '{m.get('name')}', which the pod does not have")
            shm = mounts.get("/dev/shm")
            if not shm:
                errors.append(f"{where}: nothing is mounted at /dev/shm")
            else:
                ed = volumes.get(shm.get("name"), {}).get("emptyDir")
                if ed is None or ed.get("medium") != "Memory":
                    errors.append(f"{where}: /dev/shm is not an emptyDir of medium Memory")
                elif not ed.get("sizeLimit"):
                    errors.append(f"{where}: the /dev/shm emptyDir has no sizeLimit")
            ckpt = flag(argv, "--checkpoint-dir")
            if not ckpt:
                errors.append(f"{where}: no --checkpoint-dir")
            elif not any(ckpt == p or ckpt.startswith(p.rstrip("/") + "/") for p in mounts if p != "/dev/shm"):
                errors.append(f"{where}: --checkpoint-dir {ckpt} is on no mounted volume (lost with the container)")
            if "livenessProbe" not in c:
                errors.append(f"{where}: no livenessProbe")
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                for r in ("cpu", "memory"):
                    if r not in res.get(part, {}):
                        errors.append(f"{where}: no resources.{part}.{r}")
    return errors


def check(docs, schema):
    errors = schema_errors(docs, schema)
    if not errors:  # semantics assume the shapes the schema checked
        errors = semantic_errors(docs)
    return errors


# Mutants for --self-test: (description, file, old text, new text). Each must
# make the check fail; the first ones are plain typos in field names.
MUTANTS = [
    ("misspelt field in a container", "trellis-job.yaml", "mountPath: /dev/shm", "mounthPath: /dev/shm"),
    ("misspelt field in the Job spec", "trellis-job.yaml", "parallelism: 4", "paralelism: 4"),
    ("misspelt field in the pod spec", "trellis-job.yaml", "restartPolicy: OnFailure", "restartPolicy: OnFailure\n      restartPolicyy: Never"),
    ("misspelt probe field", "trellis-job.yaml", "initialDelaySeconds: 10", "initialDelaySecond: 10"),
    ("misspelt emptyDir field", "trellis-job.yaml", "sizeLimit: 256Mi", "sizelimit: 256Mi"),
    ("misspelt StatefulSet field", "etcd.yaml", "serviceName: trellis-etcd", "servicename: trellis-etcd"),
    ("misspelt Service port field", "etcd.yaml", "targetPort: 2379", "tragetPort: 2379"),
    ("wrong enum value", "trellis-job.yaml", "restartPolicy: OnFailure", "restartPolicy: Sometimes"),
    ("bad quantity", "trellis-job.yaml", "memory: 8Gi", "memory: 8 GB"),
    ("c10d instead of etcd", "trellis-job.yaml", "- --rdzv-backend\n            - etcd", "- --rdzv-backend\n            - c10d"),
    ("endpoint names no Service", "trellis-job.yaml", "trellis-etcd:2379", "etcd-client:2379"),
    ("endpoint on the wrong port", "trellis-job.yaml", "trellis-etcd:2379", "trellis-etcd:2390"),
    ("/dev/shm not Memory", "trellis-job.yaml", "medium: Memory", "medium: \"\""),
    ("/dev/shm mounted elsewhere", "trellis-job.yaml", "mountPath: /dev/shm", "mountPath: /shm"),
    ("Secret key missing", "trellis-job.yaml", "key: token", "key: job-token"),
    ("Secret missing", "trellis-job.yaml", "name: trellis-job-token", "name: trellis-token"),
    ("nnodes MAX above parallelism", "trellis-job.yaml", '"2:4"', '"2:8"'),
    ("claim missing", "trellis-job.yaml", "claimName: trellis-checkpoints", "claimName: checkpoints"),
    ("checkpoints on no volume", "trellis-job.yaml", "/ckpt/$(JOB_NAME)", "/data/$(JOB_NAME)"),
    ("undefined variable in args", "trellis-job.yaml", "- $(JOB_NAME)", "- $(JOB)"),
    ("Service selects other pods", "etcd.yaml", "  selector:\n    app.kubernetes.io/name: trellis-etcd", "  selector:\n    app.kubernetes.io/name: etcd"),
]


def self_test(manifest_dir, schema):
    texts = {}
    for path in sorted(glob.glob(os.path.join(manifest_dir, "*.yaml"))):
        with open(path) as f:
            texts[os.path.basename(path)] = f.read()
    failures = 0
    for desc, fname, old, new in MUTANTS:
        if texts.get(fname, "").count(old) < 1:
            print(f"self-test: mutant '{desc}': '{old}' is not in {fname} (update MUTANTS)")
            failures += 1
            continue
        mutated = dict(texts)
        mutated[fname] = texts[fname].replace(old, new, 1)
        docs = []
        for n, t in sorted(mutated.items()):
            docs.extend(parse(n, t))
        errors = check(docs, schema)
        if errors:
            print(f"self-test: rejected as expected: {desc}: {errors[0]}")
        else:
            print(f"self-test: NOT rejected: {desc} ({fname}: '{old}' -> '{new}')")
            failures += 1
    return failures


def main(argv):
    selftest = "--self-test" in argv
    args = [a for a in argv if a != "--self-test"]
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(os.path.join(HERE, "k8s_schema.json")) as f:
        schema = json.load(f)
    jsonschema.Draft7Validator.check_schema(schema)
    docs = load(args[0])
    errors = check(docs, schema)
    kinds = ", ".join(f"{d.get('kind')} {d['metadata'].get('name')}" for _, _, d in docs)
    if errors:
        for e in errors:
            print("error:", e)
        print(f"k8s_check: {len(errors)} error(s) in {len(docs)} document(s)")
        return 1
    print(f"k8s_check: {len(docs)} documents pass the schema and semantic checks: {kinds}")
    if selftest:
        failures = self_test(args[0], schema)
        if failures:
            print(f"k8s_check: self-test: {failures} of {len(MUTANTS)} mutants not rejected")
            return 1
        print(f"k8s_check: self-test: all {len(MUTANTS)} mutants rejected")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
