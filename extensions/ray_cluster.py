"""The Ray extension's cluster side: ``connect`` (a Ray driver that fails clearly, and refuses a
cluster anyone can join), the loopback switch, the cluster's token file, and ``local_cluster``,
a cluster of a head and worker nodes on this machine (``python -m extensions.ray_cluster
--workers 1``). Ray is imported inside the functions that use it.

Who may connect (docs/ray.md, "Security"): a cluster with token authentication
(``RAY_AUTH_MODE=token``) admits only the holders of its token, and ``connect`` turns a refusal
for want of it into one clear error within a second; a cluster off loopback without it admits
anyone who reaches its ports to run code on every node, this one included, so ``connect``
refuses it unless ``--ray_allow_unauthenticated`` says to go on.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

from plumbing.config import RunError


class NoRayCluster(RunError, ConnectionError):
    """Nothing listens at the --ray address (within ``connect``'s wait), or the cluster never
    offers what the searcher actors ask for."""


class RayClusterRefused(RunError, ConnectionError):
    """The Ray cluster is there but refused this process: it runs with token authentication
    (RAY_AUTH_MODE=token) and this process has no token or the wrong one."""


class RayClusterOpen(RunError, ConnectionError):
    """The Ray cluster is off loopback and admits clients without a token: anyone who reaches
    its ports can run code on its nodes. Refused unless --ray_allow_unauthenticated."""


def _host_port(address: str) -> tuple[str, int] | None:
    host, _, port = address.rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (127.0.0.0/8, ::1)."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(found) and all(ipaddress.ip_address(f[4][0]).is_loopback for f in found)


def _resolve(address: str) -> str:
    """``auto`` (or empty) as the address Ray would use: RAY_ADDRESS, or the cluster this
    machine runs; empty when there is none (ray.init then says so)."""
    if address not in ("", "auto"):
        return address
    from ray._private.services import get_ray_address_from_environment

    try:
        return get_ray_address_from_environment("auto", None) or ""
    except ConnectionError:
        return ""


PROBE = """
import sys
from ray._raylet import GcsClient
from ray.exceptions import AuthenticationError
try:
    GcsClient(address=sys.argv[1]).cluster_id
except AuthenticationError:
    sys.exit(3)
"""


def requires_token(address: str, timeout_s: float = 60.0) -> bool:
    """Whether the Ray cluster at ``address`` refuses a client without a token: its GCS asked
    once by a process with no token and token authentication off (RAY_AUTH_MODE=disabled);
    a process of its own, since Ray reads the mode and the token once per process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["RAY_AUTH_MODE"] = "disabled"
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE, address],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise NoRayCluster(
            f"the Ray cluster at {address} did not answer in {timeout_s:g}s"
        ) from None
    if done.returncode not in (0, 3):
        said = done.stderr.strip().splitlines()[-1:] or ["?"]
        raise NoRayCluster(f"could not ask the Ray cluster at {address}: {said[0][:300]}")
    return done.returncode == 3


def refuse_open(address: str) -> None:
    """Raise RayClusterOpen if the cluster at ``address`` is off loopback and admits clients
    without a token (``requires_token``); a loopback cluster is this machine's own."""
    host = _host_port(address)[0]
    if not is_loopback(host) and not requires_token(address):
        raise RayClusterOpen(
            f"the Ray cluster at {address} admits clients without a token: anyone who reaches "
            "its ports runs code on every node, this one included. Start it with "
            "RAY_AUTH_MODE=token (docs/ray.md, Security), or pass --ray_allow_unauthenticated "
            "to accept that"
        )


def connect(
    address: str,
    *,
    runtime_env: dict | None = None,
    wait_s: float = 60.0,
    allow_unauthenticated: bool = False,
) -> None:
    """``ray.init(address)`` that fails clearly. Ray's own retries 20 times a second apart and
    then raises a bare ``ConnectionError("Failed to connect to Ray cluster at ...")``, the reason
    (``InvalidAuthToken``) only in its log lines; here a GCS that refuses our token is a
    ``RayClusterRefused`` within a second, and an address where nothing listens for ``wait_s``
    (a cluster may still be starting) a NoRayCluster that says so. A cluster off loopback that
    requires no token is a ``RayClusterOpen`` unless ``allow_unauthenticated``."""
    target = _host_port(address) if address not in ("", "auto") else None
    if target is not None:  # first, before Ray reads its token: the cluster may still be starting
        deadline = time.monotonic() + wait_s
        while True:
            try:
                socket.create_connection(target, timeout=5.0).close()
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise NoRayCluster(
                        f"no Ray cluster at {address} within {wait_s:g}s: {exc} (is `ray start "
                        "--head` running there?)"
                    ) from None
                time.sleep(1.0)
    import ray
    from ray._raylet import GcsClient  # ray.init's own client
    from ray.exceptions import AuthenticationError

    if ray.is_initialized():
        return
    resolved = _resolve(address)
    target = _host_port(resolved)
    loopback = target is not None and is_loopback(target[0])
    if loopback:
        keep_loopback()
    if target is not None and not allow_unauthenticated:
        refuse_open(resolved)
    if target is not None:
        try:
            _ = GcsClient(address=resolved).cluster_id
        except AuthenticationError as exc:
            raise RayClusterRefused(_refused_text(resolved, exc)) from None
    try:
        ray.init(address=resolved or "auto", runtime_env=runtime_env, log_to_driver=True)
    except ConnectionError as exc:
        cause = f"{exc.__cause__!r}"
        if "InvalidAuthToken" in cause or "AuthenticationError" in cause:
            raise RayClusterRefused(_refused_text(resolved, exc.__cause__)) from None
        raise


def keep_loopback() -> None:
    """Keep a one-machine cluster on 127.0.0.1. ray.init rewrites a loopback address to this
    machine's own IP (services.resolve_ip_for_localhost -> get_node_ip_address), where a
    cluster bound to 127.0.0.1 is not listening: a 20 s hang, then "Failed to connect". The
    switch Ray offers, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, is read once at `import ray`; this
    sets the constant it feeds (read at each call; a private name, hence the pinned Ray) and
    the variable for child processes."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def _refused_text(address: str, exc: BaseException | None) -> str:
    mode = os.environ.get("RAY_AUTH_MODE", "(unset)")
    source = (
        "RAY_AUTH_TOKEN"
        if os.environ.get("RAY_AUTH_TOKEN")
        else os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token"
    )
    said = str(exc).split(". ")[0] if exc else "?"
    return (
        f"the Ray cluster at {address} refused this process: it requires token authentication "
        f"and our token is missing or wrong (RAY_AUTH_MODE={mode}, token from {source}). Run "
        "with RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN or in a file named "
        f"by RAY_AUTH_TOKEN_PATH. Ray said: {said}"
    )


# ----------------------------------------------------------------------------- one machine

DEFAULT_TOKEN_FILE = "~/.ray/auth_token"  # where Ray itself looks when no path is given


def token_file(path: str) -> Path:
    """The cluster's token file at ``path``, made private from the start: a new one is created
    with mode 600 (O_EXCL and O_NOFOLLOW: never through a name someone else planted) in a
    directory only this user may write (made with mode 700 when missing); an existing one must
    be this user's alone (mode 600 or less) in such a directory. Anything else is a RunError
    naming the file: a token others could read, or a directory others could swap it in."""
    file = Path(path).expanduser().absolute()
    folder = file.parent
    if not folder.exists():
        folder.mkdir(mode=0o700, parents=True)
    info = os.stat(folder)
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RunError(
            f"--token_file {file}: its directory {folder} must belong to this user and be "
            "writable by no one else (mkdir -m 700 a directory of your own for it)"
        )
    if file.exists() or file.is_symlink():
        info = os.lstat(file)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise RunError(
                f"--token_file {file} exists and is not a file of this user's alone (mode 600): "
                "others may have read it; remove it and start again for a new token"
            )
        return file
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32))
    return file


def local_cluster(
    workers: int, cpus: int, token_path: str, gpus: int = 0, port: int = 6390
) -> None:
    """A Ray cluster of a head and ``workers`` worker nodes on this machine, every address
    127.0.0.1 (the head at ``port``), token authentication on (the token in ``token_path``,
    created private: ``token_file``), until Ctrl-C or SIGTERM; prints the address. Each worker
    node offers a ``searcher`` resource per CPU, so ``--ray_resources searcher=1`` puts
    searchers on the worker nodes, not beside the trainer. Why not ``ray start`` twice: its
    worker start rewrites a loopback address to the machine's own IP, and the switch that stops
    that makes it refuse to start a worker node (``keep_loopback``). Drivers need
    RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH=``token_path`` (unless it is Ray's default)."""
    import signal

    from ray._raylet import AuthenticationTokenLoader, Config
    from ray.cluster_utils import Cluster

    keep_loopback()  # its processes inherit the switch
    path = token_file(token_path)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(path))
    os.environ.pop("RAY_AUTH_TOKEN", None)
    # Ray read the mode and token when it was imported: read them again, or this process's own
    # client (the Cluster's) is refused by the GCS it just started.
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    node = dict(num_cpus=cpus, num_gpus=gpus, node_ip_address="127.0.0.1")
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(node, gcs_server_port=port, include_dashboard=False, no_monitor=True),
    )
    for _ in range(workers):
        cluster.add_node(**node, resources={"searcher": cpus})
    cluster.wait_for_nodes()
    print(
        f"Ray cluster of {workers + 1} nodes at {cluster.address}; drivers: "
        f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={path}",
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        cluster.shutdown()
        print("Ray cluster stopped", flush=True)


def main(argv: list[str]) -> None:
    """``python -m extensions.ray_cluster --workers N``: ``local_cluster``."""
    import argparse

    parser = argparse.ArgumentParser(description=local_cluster.__doc__.split(". ")[0])
    parser.add_argument("--workers", type=int, default=1, help="worker nodes beside the head")
    parser.add_argument("--cpus", type=int, default=1, help="CPUs per node")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per node")
    parser.add_argument("--port", type=int, default=6390, help="the head's port on 127.0.0.1")
    parser.add_argument(
        "--token_file",
        default=DEFAULT_TOKEN_FILE,
        help="the cluster's token: read if it exists (this user's alone), else created with "
        "mode 600 in a directory only this user may write",
    )
    args = parser.parse_args(argv)
    local_cluster(args.workers, args.cpus, args.token_file, args.gpus, args.port)


if __name__ == "__main__":
    from extensions.cli import run_cli

    sys.exit(run_cli(main))
