"""The weight group's rendezvous store: a torch.distributed Store that only the holders of a
group's secret can reach, served by the Ray driver on the group's address alone.

Why not torch's ``TCPStore``: it listens on every interface whatever host it is given, has no
authentication, and lists its keys to any client (``list_keys``), so a key prefix hides
nothing; whoever reaches the driver's node could flood it, plant rendezvous keys, or take a
member's rank. Here:

* ``StoreServer`` (in the driver) listens on one address, the one the group uses, on a port the
  OS picks. A connection must first prove it holds the secret of an open group (an HMAC of a
  random challenge, within ``HANDSHAKE_S``; the server proves it too), else it is closed
  having read nothing. At most ``MAX_PENDING`` connections wait to prove it at once, and a new
  one pushes the oldest out: a member proves it within moments, so connections that never do
  cannot keep it out unless they come faster than that.
* Each group incarnation has a secret of its own (``open``, 32 random bytes), which reaches its
  members in the group's plan over Ray's authenticated channel (the board actor). A client
  sees only the keys of the group whose secret it proved: the secret is the key prefix no one
  can guess, and opening a new group closes the old one (its keys dropped, its clients cut).
* ``GroupStore`` is the members' client (and the driver's own): ``set``/``get``/``wait``/
  ``add``/``check``/``compare_set``, what torch forwards from a process group's rendezvous to a
  store written in Python, in frames of length-prefixed bytes (nothing is unpickled).

The handshake authenticates; it does not encrypt. What crosses the store (each rank's gloo
address, NCCL's unique id) and the weights themselves travel in clear: docs/ray.md, "Security".
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import hashlib
import hmac
import secrets
import socket
import struct
import threading

import torch.distributed as dist

MAGIC = b"TBA-WG\x00\x01"  # the protocol and its version
NONCE_BYTES = 32
HANDSHAKE_S = 5.0  # a connection proves the secret within this, or is closed
MAX_PENDING = 64  # connections proving it at once; a new one closes the oldest
MAX_BLOB = 1 << 20  # a key or value; a rendezvous value is a few hundred bytes
MAX_ARGS = 4096

SET, GET, ADD, CHECK, WAIT, COMPARE_SET = range(1, 7)
OK, TIMEOUT, CLOSED = range(3)


def _proof(secret: bytes, nonce: bytes, side: bytes) -> bytes:
    return hmac.new(secret, side + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError("the group store's connection closed")
        data += chunk
    return bytes(data)


def _send_frame(sock: socket.socket, code: int, args: list[bytes]) -> None:
    parts = [struct.pack(">BH", code, len(args))]
    for arg in args:
        parts += [struct.pack(">I", len(arg)), arg]
    sock.sendall(b"".join(parts))


def _recv_frame(sock: socket.socket) -> tuple[int, list[bytes]]:
    code, count = struct.unpack(">BH", _recv_exact(sock, 3))
    if count > MAX_ARGS:
        raise ConnectionError(f"a frame of {count} arguments")
    args = []
    for _ in range(count):
        (size,) = struct.unpack(">I", _recv_exact(sock, 4))
        if size > MAX_BLOB:
            raise ConnectionError(f"an argument of {size} bytes")
        args.append(_recv_exact(sock, size))
    return code, args


def _cut(sock: socket.socket) -> None:
    """Close ``sock`` so that a thread blocked reading it wakes (close alone does not)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class StoreServer:
    """The store, in the driver: listens on ``host`` only (the group's address), on a port the
    OS picks (``port``), until ``close``. Each connection is served on a thread of its own."""

    def __init__(self, host: str):
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        self.sock = socket.create_server((host, 0), family=family)
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.cond = threading.Condition()
        self.spaces: dict[bytes, dict[str, bytes]] = {}  # secret -> that group's keys
        self.clients: dict[bytes, set[socket.socket]] = {}
        self.pending: collections.deque[socket.socket] = collections.deque()  # unproven
        self.refused = 0  # connections closed unproven: for tests and logs
        self.closed = False
        self.thread = threading.Thread(target=self._accept, name="tba-group-store", daemon=True)
        self.thread.start()

    def open(self) -> str:
        """A new group's secret (hex); every older group's keys and clients are dropped."""
        secret = secrets.token_bytes(32)
        with self.cond:
            for old in list(self.spaces):
                self._drop(old)
            self.spaces[secret] = {}
            self.clients[secret] = set()
        return secret.hex()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            for old in list(self.spaces):
                self._drop(old)
            for conn in self.pending:
                _cut(conn)
        _cut(self.sock)

    def _drop(self, secret: bytes) -> None:
        """(Holding ``cond``.) Forget a group: its waits end, its clients are cut."""
        del self.spaces[secret]
        for client in self.clients.pop(secret):
            _cut(client)  # its thread's recv fails, and it ends
        self.cond.notify_all()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with self.cond:
                if self.closed:
                    conn.close()
                    return
                if len(self.pending) >= MAX_PENDING:
                    _cut(self.pending.popleft())
                self.pending.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _handshake(self, conn: socket.socket) -> bytes | None:
        """The secret ``conn`` proved, or None."""
        try:
            conn.settimeout(HANDSHAKE_S)
            nonce = secrets.token_bytes(NONCE_BYTES)
            conn.sendall(MAGIC + nonce)
            reply = _recv_exact(conn, len(MAGIC) + NONCE_BYTES)
        except OSError:
            return None
        finally:
            with self.cond:
                if conn in self.pending:
                    self.pending.remove(conn)
        with self.cond:
            for secret in self.spaces:
                if reply[: len(MAGIC)] == MAGIC and hmac.compare_digest(
                    reply[len(MAGIC) :], _proof(secret, nonce, b"member")
                ):
                    self.clients[secret].add(conn)
                    conn.settimeout(None)
                    conn.sendall(_proof(secret, nonce, b"driver"))
                    return secret
        return None

    def _serve(self, conn: socket.socket) -> None:
        secret = self._handshake(conn)
        if secret is None:
            self.refused += 1
            conn.close()
            return
        try:
            while True:
                code, args = _recv_frame(conn)
                status, out = self._do(secret, code, args)
                _send_frame(conn, status, out)
        except (OSError, ConnectionError, ValueError, struct.error):
            pass  # the client left, or its group was dropped: nothing more to serve
        finally:
            with self.cond:
                self.clients.get(secret, set()).discard(conn)
            conn.close()

    def _do(self, secret: bytes, code: int, args: list[bytes]) -> tuple[int, list[bytes]]:
        """One request in the group of ``secret``: (status, the reply's arguments)."""
        with self.cond:
            keys = self.spaces.get(secret)
            if keys is None:
                return CLOSED, []
            if code in (GET, WAIT):
                seconds = int(args[0]) / 1000
                wanted = [a.decode() for a in args[1:]]

                def ready():
                    return secret not in self.spaces or all(k in keys for k in wanted)

                if not self.cond.wait_for(ready, seconds):
                    return TIMEOUT, []
                if secret not in self.spaces:
                    return CLOSED, []
                return OK, [keys[wanted[0]]] if code == GET else []
            key = args[0].decode()
            out = []
            if code == SET:
                keys[key] = args[1]
            elif code == ADD:
                keys[key] = str(int(keys.get(key, b"0")) + int(args[1])).encode()
                out = [keys[key]]
            elif code == CHECK:
                out = [b"1" if all(a.decode() in keys for a in args) else b"0"]
            elif code == COMPARE_SET:
                current = keys.get(key)
                if (current is None and args[1] == b"") or current == args[1]:
                    keys[key] = current = args[2]
                out = [current if current is not None else args[1]]
            else:
                raise ValueError(f"unknown request {code}")
            self.cond.notify_all()
            return OK, out


class GroupStore(dist.Store):
    """A client of ``StoreServer`` for the group whose ``secret`` (hex) it holds: a torch Store,
    so a process group rendezvouses on it. Every wait ends by ``timeout`` (the group's)."""

    def __init__(self, host: str, port: int, secret: str, timeout: datetime.timedelta):
        super().__init__()
        self.wait_s = timeout.total_seconds()
        self.lock = threading.Lock()  # one request at a time on the connection
        key = bytes.fromhex(secret)
        try:
            self.sock = socket.create_connection((host, port), timeout=min(self.wait_s, 30.0))
        except OSError as exc:
            raise dist.DistStoreError(f"no weight group's store at {host}:{port}: {exc}") from None
        try:
            hello = _recv_exact(self.sock, len(MAGIC) + NONCE_BYTES)
            if hello[: len(MAGIC)] != MAGIC:
                raise ConnectionError(f"{host}:{port} is not a weight group's store")
            nonce = hello[len(MAGIC) :]
            self.sock.sendall(MAGIC + _proof(key, nonce, b"member"))
            proof = _recv_exact(self.sock, 32)
        except (OSError, ConnectionError) as exc:
            self.sock.close()
            raise dist.DistStoreError(
                f"the weight group's store at {host}:{port} refused us (not this group's secret, "
                f"or the group is closed): {exc}"
            ) from None
        if not hmac.compare_digest(proof, _proof(key, nonce, b"driver")):
            self.sock.close()
            raise dist.DistStoreError(f"the store at {host}:{port} does not hold our secret")
        self.sock.settimeout(None)

    def _call(self, code: int, args: list[bytes], wait_s: float = 0.0) -> list[bytes]:
        try:
            with self.lock:
                self.sock.settimeout(wait_s + 30.0)  # the server answers a wait when it ends
                _send_frame(self.sock, code, args)
                status, out = _recv_frame(self.sock)
        except (OSError, ConnectionError) as exc:
            raise dist.DistStoreError(f"the weight group's store: {exc}") from None
        if status == TIMEOUT:
            raise dist.DistStoreError(f"the weight group's store: no key within {wait_s:g}s")
        if status == CLOSED:
            raise dist.DistStoreError("the weight group's store closed this group")
        return out

    def _wait_args(self, keys: list[str], timeout) -> tuple[list[bytes], float]:
        seconds = self.wait_s if timeout is None else timeout.total_seconds()
        return [str(int(seconds * 1000)).encode(), *(k.encode() for k in keys)], seconds

    def set(self, key, value) -> None:
        self._call(SET, [key.encode(), _bytes(value)])

    def get(self, key) -> bytes:
        args, seconds = self._wait_args([key], None)
        return self._call(GET, args, seconds)[0]

    def wait(self, keys, timeout=None) -> None:
        args, seconds = self._wait_args(list(keys), timeout)
        self._call(WAIT, args, seconds)

    def add(self, key, amount) -> int:
        return int(self._call(ADD, [key.encode(), str(int(amount)).encode()])[0])

    def check(self, keys) -> bool:
        return self._call(CHECK, [k.encode() for k in keys])[0] == b"1"

    def compare_set(self, key, expected, desired) -> bytes:
        return self._call(COMPARE_SET, [key.encode(), _bytes(expected), _bytes(desired)])[0]

    def close(self) -> None:
        """Cut the connection: a wait in progress on another thread fails at once."""
        _cut(self.sock)
