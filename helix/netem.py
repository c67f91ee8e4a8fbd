"""Emulated regions on one Linux machine: network namespaces joined by shaped, delayed links.

:class:`Wan` owns everything it creates, from ``__enter__`` to ``__exit__``: one network
namespace per region, one *router* namespace in the middle, a veth pair from each region to the
router, the qdiscs that shape the links and the process that delays them. Processes run in a
region with :meth:`Wan.exec_prefix` (``ip netns exec NS``); a thread of this process enters one
with :meth:`Wan.entered` (``setns(2)`` on the calling thread only: sockets it creates, and
threads it starts, live in that region). Needs root, ``ip`` and ``tc`` (iproute2), and
``/dev/net/tun`` where the kernel has no netem.

Topology. Region ``i`` has address ``10.99.i.2`` on its veth ``wan0``, default route via the
router's ``10.99.i.1``; region-to-region traffic crosses the router, so every directed pair of
regions is its own link:

* **Bandwidth**: the kernel's ``htb`` on the router's veth towards the destination region, one
  class per source region (``u32`` match on the source subnet), rate = ceil = the link's
  ``bandwidth_gbps``. A link without bandwidth is not shaped.
* **Latency**: ``netem`` in that class where the kernel has it (:func:`netem_available`).
  Where it does not (these machines), a *delay line*: the router's policy routing sends every
  packet that arrives from a region to a TUN device; a small process (``python -m helix.netem
  delay-line``, :func:`run_delay_line`) reads each packet, holds it for the latency of its
  (source region, destination region) link and writes it back, and the kernel forwards it to
  the destination's veth, where htb shapes it. A link is so a delay then a FIFO server at the
  link's rate: the same arrival times as the simulator's FIFO server then latency. The delay line
  is one Python process: packets are held to about ±1 ms; it uses a core's share per link's
  packet rate (a few hundred packets/s at the few Mbit/s the benches use).

Clean-up: every namespace is named ``helixwan-<pid>-<token>-<role>``. ``__exit__`` (also on an
exception or Ctrl-C) kills the processes still inside this run's namespaces (by pid, from ``ip
netns pids``) and deletes the namespaces, which removes their veths and qdiscs; the host's own
namespace is never touched. :func:`cleanup_stale` removes what a run killed with ``-9`` left
behind (namespaces whose owner pid is gone); ``Wan`` calls it on entry.
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import json
import logging
import os
import secrets
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from helix.errors import HelixError

log = logging.getLogger(__name__)

NS_PREFIX = "helixwan-"
SUBNET = "10.99"  # region i: 10.99.i.0/24 (inside this run's namespaces only: no clash with the host)
CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
DELAY_TABLE = 100
DELAY_DEVICE = "dly0"


class WanError(HelixError):
    """The emulated WAN could not be built (not root, no iproute2, a kernel without what it needs)."""


@dataclass(frozen=True, slots=True)
class LinkShape:
    """One directed link between two regions: ``bandwidth_gbps`` (10^9 bits/s; None = not shaped)
    and one-way ``latency_ms``."""

    bandwidth_gbps: float | None = None
    latency_ms: float = 0.0


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise WanError(f"{cmd[0]}: not found (the emulated WAN needs iproute2's ip and tc)") from None
    if check and done.returncode != 0:
        raise WanError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise WanError(f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _remove_namespace(ns: str) -> None:
    """Kill the processes inside ``ns`` (by pid), then delete it (its veths and qdiscs go with it)."""
    pids = [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pids and time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
        time.sleep(0.02)
    _run("ip", "netns", "del", ns, check=False)


def cleanup_stale() -> list[str]:
    """Delete the namespaces of runs whose process is gone (killed with -9); returns their names."""
    removed = []
    for ns in _namespaces():
        if not ns.startswith(NS_PREFIX):
            continue
        owner = ns[len(NS_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            _remove_namespace(ns)
            removed.append(ns)
    return removed


def netem_available(namespace: str) -> bool:
    """Whether this kernel has the netem qdisc (tried once on ``namespace``'s loopback)."""
    ok = _run("tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
              check=False).returncode == 0  # fmt: skip
    if ok:
        _run("tc", "-n", namespace, "qdisc", "del", "dev", "lo", "root", check=False)
    return ok


@dataclass
class Wan:
    """Regions joined by shaped links (see the module doc). ``links[(src, dst)]`` shapes traffic
    from region ``src`` to region ``dst``; pairs not listed are neither shaped nor delayed.
    ``delay``: ``auto`` (netem where the kernel has it, else the delay line), ``netem`` or ``relay``."""

    regions: Sequence[str]
    links: Mapping[tuple[str, str], LinkShape]
    mtu: int = 1500
    delay: str = "auto"
    burst_bytes: int = 4096  # htb bucket beyond one MTU: how far a link may run ahead of its rate
    queue_ms: float = 100.0  # a link's buffer, in time at its rate (at least 8 packets): a router's, not a
    # bottomless FIFO (with one, a heartbeat would wait behind seconds of activations on a slow link)
    token: str = field(default_factory=lambda: f"{os.getpid()}-{secrets.token_hex(3)}")
    delay_method: str = "none"  # what __enter__ chose: none | netem | relay
    _index: dict[str, int] = field(default_factory=dict)
    _made: list[str] = field(default_factory=list)
    _relay: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        if len(set(self.regions)) != len(self.regions) or not 1 <= len(self.regions) <= 200:
            raise WanError(f"regions must be 1 to 200 distinct names, got {list(self.regions)}")
        self._index = {name: i for i, name in enumerate(self.regions)}
        for (src, dst), shape in self.links.items():
            for end in (src, dst):
                if end not in self._index:
                    raise WanError(f"link {src}->{dst}: region {end!r} is not one of {list(self.regions)}")
            if src == dst:
                raise WanError(f"link {src}->{dst}: a region's own traffic does not cross the WAN")
            if shape.bandwidth_gbps is not None and shape.bandwidth_gbps <= 0:
                raise WanError(f"link {src}->{dst}: bandwidth_gbps must be positive, got {shape.bandwidth_gbps}")
            if shape.latency_ms < 0:
                raise WanError(f"link {src}->{dst}: latency_ms must be 0 or more, got {shape.latency_ms}")
        if self.delay not in ("auto", "netem", "relay"):
            raise WanError(f"delay must be auto, netem or relay, got {self.delay!r}")

    # -- names ------------------------------------------------------------------------------------
    @property
    def router(self) -> str:
        return f"{NS_PREFIX}{self.token}-router"

    def namespace(self, region: str) -> str:
        return f"{NS_PREFIX}{self.token}-r{self._index[region]}"

    def address(self, region: str) -> str:
        """The region's IP address, reachable from every other region."""
        return f"{SUBNET}.{self._index[region]}.2"

    def exec_prefix(self, region: str) -> list[str]:
        """Prefix a command line with this to run it inside ``region``."""
        return ["ip", "netns", "exec", self.namespace(region)]

    @contextlib.contextmanager
    def entered(self, region: str) -> Iterator[None]:
        """Run the body with the *calling thread* inside ``region``'s namespace (threads it starts
        stay there), then return it to where it was."""
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            _setns(f"/run/netns/{self.namespace(region)}")
            try:
                yield
            finally:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(home, CLONE_NEWNET) != 0:
                    raise WanError(f"could not return to the original namespace: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(home)

    @property
    def delay_line_pid(self) -> int | None:
        """The delay line's process id (its CPU is the emulation's cost), None without one."""
        return self._relay.pid if self._relay is not None else None

    def link_bytes(self, src: str, dst: str) -> int:
        """Bytes (Ethernet frames) the shaped link ``src -> dst`` carried so far (``tc -s class``)."""
        i, j = self._index[src], self._index[dst]
        out = _run("tc", "-n", self.router, "-s", "class", "show", "dev", f"w{j}", "classid", f"1:{10 + i}").stdout
        words = out.split()
        return int(words[words.index("Sent") + 1]) if "Sent" in words else 0

    # -- life cycle -------------------------------------------------------------------------------
    def __enter__(self) -> Wan:
        if os.geteuid() != 0:
            raise WanError("the emulated WAN needs root (network namespaces and tc)")
        removed = cleanup_stale()
        if removed:
            log.warning("removed %d namespaces left by earlier runs: %s", len(removed), ", ".join(removed))
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the delay line, kill what still runs inside, delete every namespace made."""
        if self._relay is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._relay.pid, signal.SIGKILL)
            self._relay.wait(timeout=10)
            if self._relay.stdout is not None:
                self._relay.stdout.close()
            self._relay = None
        for ns in reversed(self._made):
            _remove_namespace(ns)
        self._made.clear()

    def _add_namespace(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self._made.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _build(self) -> None:
        router = self.router
        self._add_namespace(router)
        _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for region, i in self._index.items():
            ns = self.namespace(region)
            self._add_namespace(ns)
            _run("ip", "-n", router, "link", "add", f"w{i}", "mtu", str(self.mtu), "type", "veth",
                 "peer", "name", "wan0", "netns", ns)  # fmt: skip
            _run("ip", "-n", ns, "link", "set", "wan0", "mtu", str(self.mtu), "up")
            _run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i}.2/24", "dev", "wan0")
            _run("ip", "-n", ns, "route", "add", "default", "via", f"{SUBNET}.{i}.1")
            _run("ip", "-n", router, "addr", "add", f"{SUBNET}.{i}.1/24", "dev", f"w{i}")
            _run("ip", "-n", router, "link", "set", f"w{i}", "up")
        delayed = any(s.latency_ms > 0 for s in self.links.values())
        if delayed:
            netem = self.delay != "relay" and netem_available(router)
            if self.delay == "netem" and not netem:
                raise WanError("this kernel has no netem qdisc (delay='netem'); use delay='relay' or 'auto'")
            self.delay_method = "netem" if netem else "relay"
        self._shape()
        if self.delay_method == "relay":
            self._start_delay_line()

    def _shape(self) -> None:
        router = self.router
        for dst, j in self._index.items():
            incoming = {self._index[s]: shape for (s, d), shape in self.links.items() if d == dst}
            if not incoming:
                continue
            dev = f"w{j}"
            _run("tc", "-n", router, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb")
            for i, shape in sorted(incoming.items()):
                classid = f"1:{10 + i}"
                rate = f"{shape.bandwidth_gbps * 1e9:.0f}bit" if shape.bandwidth_gbps else "100gbit"
                burst = str(self.mtu + self.burst_bytes)
                _run("tc", "-n", router, "class", "add", "dev", dev, "parent", "1:", "classid", classid, "htb",
                     "rate", rate, "ceil", rate, "burst", burst, "cburst", burst)  # fmt: skip
                if self.delay_method == "netem" and shape.latency_ms > 0:
                    _run("tc", "-n", router, "qdisc", "add", "dev", dev, "parent", classid, "netem", "delay",
                         f"{shape.latency_ms}ms", "limit", "100000")  # fmt: skip
                else:
                    _run("tc", "-n", router, "qdisc", "add", "dev", dev, "parent", classid, "pfifo", "limit",
                         str(self._queue_packets(shape)))  # fmt: skip
                _run("tc", "-n", router, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                     "u32", "match", "ip", "src", f"{SUBNET}.{i}.0/24", "flowid", classid)  # fmt: skip

    def _queue_packets(self, shape: LinkShape) -> int:
        if not shape.bandwidth_gbps:
            return 10_000
        return max(8, int(shape.bandwidth_gbps * 1e9 / 8 * self.queue_ms / 1000 / self.mtu))

    def _start_delay_line(self) -> None:
        router = self.router
        delays = {f"{self._index[s]},{self._index[d]}": shape.latency_ms for (s, d), shape in self.links.items()}
        cmd = [*["ip", "netns", "exec", router], sys.executable, "-m", "helix.netem", "delay-line",
               "--device", DELAY_DEVICE, "--delays-ms", json.dumps(delays)]  # fmt: skip
        self._relay = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                       start_new_session=True, preexec_fn=_die_with_parent)  # fmt: skip
        assert self._relay.stdout is not None
        line = self._relay.stdout.readline()
        if not line.startswith(b"READY"):
            err = self._relay.stderr.read().decode(errors="replace") if self._relay.stderr else ""
            raise WanError(f"the delay line did not start: {line.decode(errors='replace')}{err.strip()}")
        _run("ip", "-n", router, "link", "set", DELAY_DEVICE, "mtu", str(self.mtu), "up")
        _run("ip", "netns", "exec", router, "sh", "-c",
             "for f in /proc/sys/net/ipv4/conf/*/rp_filter; do echo 0 > $f; done")  # fmt: skip
        _run("ip", "-n", router, "route", "add", "default", "dev", DELAY_DEVICE, "table", str(DELAY_TABLE))
        for i in self._index.values():
            _run("ip", "-n", router, "rule", "add", "iif", f"w{i}", "table", str(DELAY_TABLE), "pref", "100")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# -- the delay line (a process of its own: the GIL of a busy bench would jitter it) -----------------
def open_tun(name: str) -> int:
    """Create the TUN device ``name`` in this process's namespace; its fd (the device lives while open)."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    import fcntl

    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def run_delay_line(fd: int, delays_s: Mapping[tuple[int, int], float], stop_fd: int | None = None) -> None:
    """Read IPv4 packets from TUN ``fd``, write each back after the delay of its (source region,
    destination region) pair (third octet of ``10.99.i.x``; unknown pairs: no delay). Runs until
    ``stop_fd`` is readable (or forever)."""
    held: list[tuple[float, int, bytes]] = []
    seq = 0
    watch = [fd] + ([stop_fd] if stop_fd is not None else [])
    while True:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        ready, _, _ = select.select(watch, [], [], timeout)
        if stop_fd is not None and stop_fd in ready:
            return
        if fd in ready:
            packet = os.read(fd, 65536)
            if len(packet) >= 20 and packet[0] >> 4 == 4:
                delay = delays_s.get((packet[14], packet[18]), 0.0)
                seq += 1
                heapq.heappush(held, (time.monotonic() + delay, seq, packet))
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, _, packet = heapq.heappop(held)
            with contextlib.suppress(OSError):  # a packet the kernel refuses is a lost packet, as on a real link
                os.write(fd, packet)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m helix.netem", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("delay-line", help="hold packets from a TUN device for their link's latency")
    d.add_argument("--device", default=DELAY_DEVICE)
    d.add_argument("--delays-ms", required=True, help='JSON: {"SRC,DST": ms} with region indices')
    args = p.parse_args(argv)
    delays = {tuple(int(x) for x in k.split(",")): float(v) / 1000 for k, v in json.loads(args.delays_ms).items()}
    fd = open_tun(args.device)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("READY", flush=True)
    run_delay_line(fd, delays)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
