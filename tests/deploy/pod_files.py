"""What a container of a rendered pod spec finds on disk, as the kubelet would lay it out, and who its
process is: enough to read the mounted Secret and ConfigMap files as that process, for real (the
files are written with the kubelet's owners and modes; the reader runs with the pod's uid and groups).

The kubelet, for a `secret`, `configMap` or `projected` volume (pkg/volume/secret, configmap,
util/atomic_writer.go, volume_linux.go):
- writes each key (all of them, or the `items` listed) as a file owned by root:root, mode
  `items[].mode`, else the volume's `defaultMode` (0644 when the manifest says nothing); the
  files sit in a timestamped folder (0755) reached through the `..data` link and a link per name;
- with the pod's `fsGroup`, then gives every file and folder that group (lchown) and adds group
  read (0440: these volumes are read-only) to files, and setgid plus group r-x to folders.
The process: uid `runAsUser` (container, else pod, else the image's USER), gid `runAsGroup` (the
same order), supplementary groups `supplementalGroups` plus `fsGroup`. A root process keeps its
capability to read any file unless the container drops it (`capabilities.drop: [ALL]`).
"""
from __future__ import annotations

import base64
import os
import re
import stat
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from tests.deploy.command_lines import expand_k8s

API_DEFAULT_MODE = 0o644
FILE_FLAGS = {"--tls-cert", "--tls-key", "--tls-ca", "--etcd-cacert", "--etcd-cert", "--etcd-key"}
READER = "/usr/bin/python3"      # the system's: readable and runnable by any uid, unlike a venv in /work


@dataclass(frozen=True)
class Identity:
    uid: int
    gid: int
    groups: tuple[int, ...]
    root_caps: bool = True          # a root process that kept CAP_DAC_OVERRIDE

    def __str__(self) -> str:
        return f"uid {self.uid} gid {self.gid} groups {list(self.groups)}"


def pod_templates(objs: list[dict]) -> Iterator[tuple[str, dict]]:
    """(name, pod template) of every workload in `objs`: Deployments, Jobs and JobSets."""
    for obj in objs:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in ("Deployment", "Job"):
            yield name, obj["spec"]["template"]
        elif obj["kind"] == "JobSet":
            for rj in obj["spec"]["replicatedJobs"]:
                yield f"{name}/{rj['name']}", rj["template"]["spec"]["template"]


def identities(pod: dict, container: dict, image_user: tuple[int, int] | None) -> list[Identity]:
    """Who the container's process is; an image whose user is not known (the user's own training
    image) is tried as root and as an unprivileged uid, since either may be the one it runs as."""
    psc, csc = pod.get("securityContext", {}), container.get("securityContext", {})
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    gid = csc.get("runAsGroup", psc.get("runAsGroup"))
    extra = [*psc.get("supplementalGroups", []), *([psc["fsGroup"]] if "fsGroup" in psc else [])]
    caps = "ALL" not in csc.get("capabilities", {}).get("drop", [])
    candidates = [image_user] if image_user is not None else [(0, 0), (1000, 1000)]
    out = []
    for image_uid, image_gid in candidates:
        u = image_uid if uid is None else uid
        g = gid if gid is not None else (image_gid if u == image_uid else 0)
        out.append(Identity(u, g, tuple(sorted({g, *extra})), caps))
    return out


def pointed_at(container: dict, env: Mapping[str, str]) -> dict[str, str]:
    """The files the container's process is told to read: {path: the flag or variable naming it}."""
    argv = expand_k8s([*container.get("command", []), *container.get("args", [])], env)
    found: dict[str, str] = {}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if flag.startswith("--") and (flag.endswith("-file") or flag in FILE_FLAGS) and value.startswith("/"):
            found[value] = flag
    for name, value in env.items():
        if name.endswith("_FILE") and value.startswith("/"):
            found[value] = f"${name}"
    return found


def container_env(container: dict, fields: Mapping[str, str]) -> dict[str, str]:
    """The container's env in order ($(VAR) expanded from earlier entries), downward API values from
    `fields` (fieldPath -> value; missing ones are empty, as the kubelet makes a missing label)."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "valueFrom" in e:
            env[e["name"]] = fields.get(e["valueFrom"]["fieldRef"]["fieldPath"], "")
        else:
            env[e["name"]] = expand_k8s([e["value"]], env)[0]
    return env


class PodFiles:
    """The container's mounted Secret/ConfigMap volumes written under `root`, as the kubelet would."""

    def __init__(self, root: str, pod: dict, container: dict, sources: Mapping[tuple[str, str], dict]) -> None:
        """`sources`: the Secrets and ConfigMaps the volumes may name, by (kind, name)."""
        self.root = root
        self.mounts: dict[str, str] = {}        # mountPath -> volume name
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        fs_group = pod["spec"].get("securityContext", {}).get("fsGroup")
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            self.mounts[mount["mountPath"]] = mount["name"]
            files = _projection(volume, sources)
            if files is None:
                continue
            assert "subPath" not in mount, f"{mount['name']}: subPath mounts are not emulated here"
            self._write(self.host_path(mount["mountPath"]), files, fs_group)

    def host_path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def volume_of(self, path: str) -> str | None:
        """The volume whose mount holds `path` (the deepest mount), None when none does."""
        best = max((m for m in self.mounts if path.startswith(m.rstrip("/") + "/")), key=len, default=None)
        return None if best is None else self.mounts[best]

    def _write(self, target: str, files: dict[str, tuple[bytes, int]], fs_group: int | None) -> None:
        # emptyDir-backed volume folder (0777), the timestamped payload folder (0755), ..data, and a link
        # per top-level name, as AtomicWriter lays them out
        os.makedirs(target, exist_ok=True)
        os.chmod(target, 0o777)
        payload = os.path.join(target, "..2024_01_01_00_00_00.000000001")
        os.mkdir(payload)
        os.chmod(payload, 0o755)
        for rel, (data, mode) in files.items():
            path = os.path.join(payload, rel)
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
            os.chown(path, 0, 0)
            os.chmod(path, mode)
        os.symlink(os.path.basename(payload), os.path.join(target, "..data"))
        for top in {rel.split("/", 1)[0] for rel in files}:
            os.symlink(os.path.join("..data", top), os.path.join(target, top))
        if fs_group is not None:
            for dirpath, dirnames, filenames in os.walk(target):
                for name in [*dirnames, *filenames]:
                    _set_group(os.path.join(dirpath, name), fs_group)
            _set_group(target, fs_group)


def _set_group(path: str, gid: int) -> None:
    """SetVolumeOwnership for one entry of a read-only volume."""
    os.lchown(path, -1, gid)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return
    mask = 0o440 | (stat.S_ISGID | 0o110 if stat.S_ISDIR(info.st_mode) else 0)
    os.chmod(path, stat.S_IMODE(info.st_mode) | mask)


def _projection(volume: dict, sources: Mapping[tuple[str, str], dict]) -> dict[str, tuple[bytes, int]] | None:
    """{relative path: (content, mode)} of a secret/configMap/projected volume; None for other kinds."""
    parts: list[tuple[str, str, dict, int]] = []
    if "secret" in volume:
        v = volume["secret"]
        parts.append(("Secret", v["secretName"], v, v.get("defaultMode", API_DEFAULT_MODE)))
    elif "configMap" in volume:
        v = volume["configMap"]
        parts.append(("ConfigMap", v["name"], v, v.get("defaultMode", API_DEFAULT_MODE)))
    elif "projected" in volume:
        default = volume["projected"].get("defaultMode", API_DEFAULT_MODE)
        for src in volume["projected"].get("sources", []):
            for kind, key in (("Secret", "secret"), ("ConfigMap", "configMap")):
                if key in src:
                    parts.append((kind, src[key]["name"], src[key], default))
    else:
        return None
    files: dict[str, tuple[bytes, int]] = {}
    for kind, name, spec, default in parts:
        obj = sources.get((kind, name))
        assert obj is not None, f"the volume {volume['name']} names {kind} {name}, which no manifest makes"
        # a Secret's data and a ConfigMap's binaryData are base64; stringData and a ConfigMap's data are text
        encoded, text = ("data", "stringData") if kind == "Secret" else ("binaryData", "data")
        data = {k: base64.b64decode(v) for k, v in obj.get(encoded, {}).items()}
        data.update({k: v.encode() for k, v in obj.get(text, {}).items()})
        items = spec.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            assert item["key"] in data, f"{kind} {name} has no key {item['key']!r}"
            files[item["path"]] = (data[item["key"]], item.get("mode", default))
    return files


def unreadable(files: PodFiles, paths: Mapping[str, str], who: Identity) -> dict[str, str]:
    """{path: why} for the paths `who` cannot read, read for real by a process with that identity."""
    problems: dict[str, str] = {}
    readable: list[str] = []
    for path, named_by in paths.items():
        volume = files.volume_of(path)
        if volume is None:
            problems[path] = f"{named_by} points at {path}, which no volume of the pod provides"
        elif not os.path.lexists(files.host_path(path)):
            problems[path] = f"{named_by} points at {path}, which the volume {volume} does not hold"
        elif who.uid == 0 and not who.root_caps:
            # root without CAP_DAC_OVERRIDE/READ_SEARCH: the owner bits decide (the files are root's)
            if not os.stat(files.host_path(path)).st_mode & stat.S_IRUSR:
                problems[path] = f"{named_by} {path}: root without capabilities cannot read it"
        else:
            readable.append(path)
    if readable:
        code = ("import sys\nfor p in sys.argv[1:]:\n    try:\n        open(p, 'rb').read()\n"
                "    except OSError as e:\n        print(p, e.strerror)\n")
        done = subprocess.run([READER, "-c", code, *(files.host_path(p) for p in readable)], user=who.uid,
                              group=who.gid, extra_groups=list(who.groups), capture_output=True, text=True,
                              timeout=30, cwd="/")
        assert done.returncode == 0, done.stderr
        for line in done.stdout.splitlines():
            host, _, why = line.partition(" ")
            path = "/" + os.path.relpath(host, files.root)
            problems[path] = f"{paths[path]} {path}: {why} (as {who})"
    return problems


def image_user(dockerfile: str) -> tuple[int, int]:
    """The numeric uid:gid of a Dockerfile's last USER."""
    with open(dockerfile) as f:
        users = re.findall(r"^USER\s+(\d+):(\d+)\s*$", f.read(), re.MULTILINE)
    assert users, f"{dockerfile}: no numeric USER uid:gid"
    return int(users[-1][0]), int(users[-1][1])
