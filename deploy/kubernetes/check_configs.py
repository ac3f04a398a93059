#!/usr/bin/env python3
"""Checks the fencegate configs embedded in the Kubernetes manifests.

    python3 deploy/kubernetes/check_configs.py [MANIFEST...]

For each ConfigMap with a `fencegate.toml` key, and the workload that mounts it:

- writes the config into a temporary directory at the path the container mounts it at,
  with every absolute path in it moved under that directory, and runs
  `fencegate check-config` on it (the command is `cargo run -q --` unless the FENCEGATE
  environment variable says otherwise, e.g. FENCEGATE="cargo run -q --features etcd --");
- the files the config names on a Secret volume (TLS certificates and keys, token files)
  do not exist here: each gets a stand-in (a throwaway self-signed certificate and key
  made with openssl, a random token), after checking that the Secret volume does provide
  a file at that path (its `items`);
- checks what ties the config to the manifest: the container's `--config` is the mounted
  file; store.path is on a PersistentVolumeClaim (not an emptyDir, which the pod takes
  with it); every other path is on a volume; the probes go to admin.listen's port, in
  HTTPS if the admin listener has tls; the Services that select the pod target
  server.listen's port only; and terminationGracePeriodSeconds covers the preStop pause,
  server.shutdown_timeout and the 2 s the store has to close after it.

Needs PyYAML (installed with kubernetes-validate), openssl and Python 3.11 (tomllib).
Exits 1 with every problem listed, 0 when all is well.
"""

import os
import re
import secrets
import shlex
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path, PurePosixPath

import yaml

CONFIG_KEY = "fencegate.toml"
# How long the store has to close after server.shutdown_timeout (README, `serve`).
STORE_CLOSE_SECONDS = 2
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
CERT_KEYS = {"cert", "client_ca", "ca"}
TOKEN_KEYS = {"token_file"}
# The keys whose values name files (a route's `path` is a template, not a file).
FILE_KEYS = CERT_KEYS | TOKEN_KEYS | {"key", "proof_keys", "signing_key", "access"}


def names_a_file(key_path):
    return key_path == "store.path" or (
        last_key(key_path) in FILE_KEYS and not key_path.startswith("route["))


def duration_seconds(text):
    """A humantime duration of one unit ("30s", "500ms", "2m", "1h"), in seconds."""
    m = re.fullmatch(r"\s*(\d+)\s*(ms|s|m|h)\s*", text)
    if m is None:
        return None
    n, unit = int(m.group(1)), m.group(2)
    return n * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]


def strings(value, path=""):
    """Every string in a parsed TOML document, with its key path and its own key name."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from strings(v, f"{path}.{k}" if path else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from strings(v, f"{path}[{i}]")
    elif isinstance(value, str):
        yield path, value


def last_key(key_path):
    return re.sub(r"\[\d+\]$", "", key_path).rsplit(".", 1)[-1]


def port_of(listen):
    return int(listen.rsplit(":", 1)[1])


class Check:
    def __init__(self, tmp, fencegate):
        self.tmp = Path(tmp)
        self.fencegate = fencegate
        self.problems = []
        self.pki = None
        self.pods = 0

    def problem(self, where, message):
        self.problems.append(f"{where}: {message}")

    def stand_in_pki(self):
        """A throwaway self-signed certificate and its key (made once per run)."""
        if self.pki is None:
            d = self.tmp / "pki"
            d.mkdir()
            subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "ec",
                 "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
                 "-subj", "/CN=fencegate.example", "-addext", "subjectAltName=DNS:fencegate.example",
                 "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
                check=True, capture_output=True)
            self.pki = ((d / "cert.pem").read_bytes(), (d / "key.pem").read_bytes())
        return self.pki

    def stand_in(self, where, key_path, target, mode):
        """A stand-in with the mode the Secret volume gives its files (fencegate refuses a
        secret or key other users may read; a root-owned one may be group-readable, as
        Kubernetes mounts a Secret for the pod's fsGroup)."""
        name = last_key(key_path)
        if mode & 0o007:
            self.problem(where, f"{key_path}: the Secret volume's mode {mode:04o} lets other users read it; fencegate refuses that (use 0400 or 0440)")
        if name in CERT_KEYS:
            content = self.stand_in_pki()[0]
        elif name == "key":
            content = self.stand_in_pki()[1]
        elif name in TOKEN_KEYS:
            content = secrets.token_hex(16).encode() + b"\n"
        else:
            self.problem(where, f"{key_path}: no stand-in for a file of this kind on a Secret")
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        # As Kubernetes mounts it: owned by root, readable by the pod's fsGroup. Where the
        # check does not run as root, the file is the user's own, so only it may read it.
        target.chmod(mode if os.geteuid() == 0 else 0o600)

    def workload(self, where, pod, config_map, services):
        """Checks one ConfigMap's fencegate.toml with the pod template that mounts it."""
        spec = pod.get("spec", {})
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        config_volumes = [
            name for name, v in volumes.items()
            if v.get("configMap", {}).get("name") == config_map["metadata"]["name"]]
        containers = [
            c for c in spec.get("containers", [])
            if any(m["name"] in config_volumes for m in c.get("volumeMounts", []))]
        if len(containers) != 1:
            self.problem(where, f"{len(containers)} containers mount the ConfigMap, not one")
            return
        container = containers[0]
        where = f"{where} container {container['name']}"
        mounts = container.get("volumeMounts", [])
        config_mount = next(m for m in mounts if m["name"] in config_volumes)
        if "subPath" in config_mount:
            self.problem(where, "the ConfigMap is mounted with subPath: a change to it never reaches the file")
        config_file = PurePosixPath(config_mount["mountPath"]) / CONFIG_KEY
        args = container.get("args", []) + container.get("command", [])
        if str(config_file) not in [a for i, a in enumerate(args) if i > 0 and args[i - 1] == "--config"]:
            self.problem(where, f"the container is not started with --config {config_file}")

        text = config_map["data"][CONFIG_KEY]
        try:
            config = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            self.problem(where, f"{CONFIG_KEY} is not valid TOML: {e}")
            return

        # Each file the config names: on which of the container's mounts it lies (it must
        # be on one: the image has none), moved under this pod's directory.
        self.pods += 1
        root = self.tmp / f"pod{self.pods}"
        claims = {t["metadata"]["name"] for t in pod.get("_claim_templates", [])}
        rewritten = text
        store_path = config.get("store", {}).get("path")
        for key_path, value in strings(config):
            if not names_a_file(key_path) or (key_path == "log.access" and value in ("off", "stdout")):
                continue
            # A relative path is relative to the config file's directory, as fencegate reads it.
            path = PurePosixPath(os.path.normpath(config_file.parent / value))
            mount = max(
                (m for m in mounts if path.is_relative_to(m["mountPath"])),
                key=lambda m: len(m["mountPath"]), default=None)
            if mount is None:
                self.problem(where, f"{key_path} = {value!r} is on none of the container's volumes")
                continue
            volume = volumes.get(mount["name"])
            persistent = mount["name"] in claims or (volume is not None and "persistentVolumeClaim" in volume)
            if value == store_path and not persistent:
                self.problem(where, f"store.path {value!r} is not on a PersistentVolumeClaim: the marks would go with the pod")
            target = root / path.relative_to("/")
            if volume is not None and "secret" in volume:
                inside = str(path.relative_to(mount["mountPath"]))
                items = volume["secret"].get("items")
                if items is not None and inside not in [i["path"] for i in items]:
                    self.problem(where, f"{key_path} = {value!r}: the Secret volume {mount['name']} has no item at {inside}")
                self.stand_in(where, key_path, target, volume["secret"].get("defaultMode", 0o644))
            if value.startswith("/"):
                rewritten = rewritten.replace(f'"{value}"', f'"{target}"')

        # Probes on the admin port, Services on the proxy port, grace above the drain.
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
        server = config.get("server", {})
        server_port = port_of(server.get("listen", "127.0.0.1:8080"))
        admin = config.get("admin", {})
        admin_port = port_of(admin.get("listen", "127.0.0.1:9090"))
        admin_scheme = "HTTPS" if "tls" in admin else "HTTP"
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in container:
                get = container[probe].get("httpGet", {})
                port = get.get("port")
                if ports.get(port, port) != admin_port:
                    self.problem(where, f"{probe} goes to port {port!r}, not admin.listen's port {admin_port}")
                if get.get("scheme", "HTTP") != admin_scheme:
                    self.problem(where, f"{probe} speaks {get.get('scheme', 'HTTP')}, the admin listener {admin_scheme}")
        labels = pod.get("metadata", {}).get("labels", {})
        for svc in services:
            selector = svc["spec"].get("selector") or {}
            same_namespace = svc["metadata"].get("namespace") == pod.get("_namespace")
            if same_namespace and selector and all(labels.get(k) == v for k, v in selector.items()):
                for p in svc["spec"].get("ports", []):
                    target_port = p.get("targetPort", p["port"])
                    if ports.get(target_port, target_port) != server_port:
                        self.problem(where, f"Service {svc['metadata']['name']} port {p['port']} targets {target_port!r}, not server.listen's port {server_port}")
        shutdown = duration_seconds(server.get("shutdown_timeout", "30s"))
        pause = 0
        pre_stop = container.get("lifecycle", {}).get("preStop", {})
        command = pre_stop.get("exec", {}).get("command", [])
        if len(command) == 2 and command[0] in ("sleep", "/bin/sleep") and command[1].isdigit():
            pause = int(command[1])
        elif "sleep" in pre_stop:
            pause = pre_stop["sleep"]["seconds"]
        grace = spec.get("terminationGracePeriodSeconds", 30)
        if shutdown is None:
            self.problem(where, "server.shutdown_timeout: not a duration this check reads (one unit: 30s)")
        elif grace <= pause + shutdown + STORE_CLOSE_SECONDS:
            self.problem(where, f"terminationGracePeriodSeconds {grace} is not above preStop {pause} s + shutdown_timeout {shutdown:g} s + {STORE_CLOSE_SECONDS} s")

        file = root / config_file.relative_to("/")
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(rewritten)
        print(f"==> {where}: fencegate check-config ({CONFIG_KEY} of ConfigMap {config_map['metadata']['name']})", flush=True)
        run = subprocess.run(self.fencegate + ["check-config", "--config", str(file)])
        if run.returncode != 0:
            self.problem(where, f"fencegate check-config refused {CONFIG_KEY} (exit {run.returncode})")

    def manifest(self, file):
        with open(file) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        services = [d for d in docs if d.get("kind") == "Service"]
        pods = []
        for d in docs:
            if d.get("kind") in WORKLOADS:
                pod = dict(d["spec"]["template"])
                pod["_claim_templates"] = d["spec"].get("volumeClaimTemplates", [])
                pod["_namespace"] = d["metadata"].get("namespace")
                pods.append((f"{file}: {d['kind']} {d['metadata']['name']}", pod))
            elif d.get("kind") == "Pod":
                pods.append((f"{file}: Pod {d['metadata']['name']}", dict(d, _namespace=d["metadata"].get("namespace"))))
        found = 0
        for cm in docs:
            if cm.get("kind") != "ConfigMap" or CONFIG_KEY not in cm.get("data", {}):
                continue
            users = [
                (where, pod) for where, pod in pods
                if any(v.get("configMap", {}).get("name") == cm["metadata"]["name"]
                       for v in pod.get("spec", {}).get("volumes", []))]
            if not users:
                self.problem(f"{file}: ConfigMap {cm['metadata']['name']}", "no workload in the file mounts it")
            for where, pod in users:
                found += 1
                self.workload(where, pod, cm, services)
        return found


def main(argv):
    here = Path(__file__).resolve().parent
    files = argv[1:] or sorted(str(p) for p in here.glob("*.yaml"))
    fencegate = shlex.split(os.environ.get("FENCEGATE", "cargo run -q --"))
    with tempfile.TemporaryDirectory(prefix="fencegate-k8s-") as tmp:
        check = Check(tmp, fencegate)
        found = sum(check.manifest(f) for f in files)
        if found == 0:
            check.problem(" ".join(files), f"no ConfigMap with {CONFIG_KEY} mounted by a workload")
    for p in check.problems:
        print(f"error: {p}", file=sys.stderr)
    if check.problems:
        return 1
    print(f"{found} embedded fencegate config(s): OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
