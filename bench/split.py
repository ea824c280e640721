"""The split topology on one machine: a "draft host" and a "verify host" as two network
namespaces joined by a veth pair, each service in its own, the load tester on the draft host.

    sudo python -m bench.split --target models/stdlib-code-target --draft models/stdlib-code-draft \\
        --rtt-ms 0,10 --out deploy/loadtest -- --concurrency 1,4,16,64 --requests 64 --duration-s 60
    (or deploy/split_topology.sh with the same arguments)

    namespace specdec-d-ID  "draft host"   10.77.0.1/24 on veth sdd-ID, lo up
        draft_service    listens on 127.0.0.1 (the client reaches it over the host's loopback)
        bench.proxy      127.0.0.1 -> 10.77.0.2, adds the RTT (only when --rtt-ms > 0)
        bench.loadtest   --server <draft on 127.0.0.1>
    namespace specdec-v-ID  "verify host"  10.77.0.2/24 on veth sdv-ID, lo up
        verify_service   listens on 10.77.0.2

Nothing else is attached to the veth and neither namespace has a default route, so no traffic
leaves them. For each RTT in --rtt-ms a draft service (and a proxy) is started against the same
verify service, and the load test runs with `--tag rtt_ms=RTT`; every run goes into the same
OUT/loadtest.json and OUT/REPORT.md. Arguments after `--` go to bench.loadtest. With several
RTTs and a `--concurrency` list, the RTTs alternate at each concurrency level (all drafts are
up at once; an idle one costs no CPU), so a slow spell on a shared machine does not land on
one RTT only (`--no-interleave` runs one RTT after the other).

The delay comes from bench/proxy.py (a userspace TCP proxy), not `tc qdisc netem`, which needs
the sch_netem kernel module (often missing in containers). Everything (processes, namespaces,
and with them the veth) is torn down on exit, on error and on SIGINT/SIGTERM; `--cleanup --id
ID` does the same for a run that was killed hard (deploy/split_topology.sh runs it from a trap).
Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from bench.launch import ENV, ROOT, Service

DRAFT_IP, VERIFY_IP, PREFIX = "10.77.0.1", "10.77.0.2", 24


def names(run_id: str) -> dict:
    # interface names are at most 15 characters
    return {"ns_draft": f"specdec-d-{run_id}", "ns_verify": f"specdec-v-{run_id}",
            "if_draft": f"sdd-{run_id}"[:15], "if_verify": f"sdv-{run_id}"[:15]}


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def netns_supported() -> tuple[bool, str]:
    """Whether this process may create network namespaces (tries one)."""
    probe = f"specdec-probe-{os.getpid()}"
    try:
        r = ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return False, "iproute2 (`ip`) is not installed"
    if r.returncode != 0:
        return False, f"`ip netns add` failed: {r.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return True, ""


def setup(n: dict) -> None:
    ip("netns", "add", n["ns_draft"])
    ip("netns", "add", n["ns_verify"])
    # Create the veth pair with each end directly inside its namespace: it never exists in the host's.
    ip("link", "add", n["if_draft"], "netns", n["ns_draft"], "type", "veth", "peer", "name", n["if_verify"], "netns", n["ns_verify"])
    for ns, ifname, addr in ((n["ns_draft"], n["if_draft"], DRAFT_IP), (n["ns_verify"], n["if_verify"], VERIFY_IP)):
        ip("-n", ns, "addr", "add", f"{addr}/{PREFIX}", "dev", ifname)
        ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", ns, "link", "set", ifname, "up")


def cleanup(n: dict) -> None:
    """Kill whatever still runs in our namespaces, then delete them (which deletes the veth). Idempotent."""
    for ns in (n["ns_draft"], n["ns_verify"]):
        r = ip("netns", "pids", ns, check=False)
        pids = [int(p) for p in r.stdout.split()] if r.returncode == 0 else []
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while pids and time.monotonic() < deadline:
                pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
                time.sleep(0.1)
        ip("netns", "del", ns, check=False)


def _option(args: list[str], name: str) -> str | None:
    """The value of `name` in an argument list (`--x v` or `--x=v`; the last one wins)."""
    value = None
    for i, x in enumerate(args):
        if x == name and i + 1 < len(args):
            value = args[i + 1]
        elif x.startswith(name + "="):
            value = x.split("=", 1)[1]
    return value


def credential_args(a) -> tuple[list[str], list[str], list[str]]:
    """Flags for (verify_service, draft_service, bench.loadtest) from this command's credential
    flags, so a secured pair is load-tested as it would run: file paths only, never a token."""
    verify, draft, load = [], [], []
    if a.tls_cert:  # both services serve TLS with it; the draft and the load tester check it with --tls-ca
        if not (a.tls_key and a.tls_ca):
            raise SystemExit("error: --tls-cert needs --tls-key and --tls-ca")
        verify += ["--tls-cert", a.tls_cert, "--tls-key", a.tls_key]
        draft += ["--tls-cert", a.tls_cert, "--tls-key", a.tls_key, "--verify-tls-ca", a.tls_ca]
        load += ["--tls-ca", a.tls_ca]
        if a.tls_client_cert:  # mTLS on both hops
            if not a.tls_client_key:
                raise SystemExit("error: --tls-client-cert needs --tls-client-key")
            verify += ["--tls-client-ca", a.tls_ca]
            draft += ["--tls-client-ca", a.tls_ca, "--verify-tls-cert", a.tls_client_cert, "--verify-tls-key", a.tls_client_key]
            load += ["--tls-cert", a.tls_client_cert, "--tls-key", a.tls_client_key]
    elif a.tls_key or a.tls_ca or a.tls_client_cert:
        raise SystemExit("error: the TLS flags need --tls-cert")
    if a.verify_token_file:  # draft -> verify
        verify += ["--auth-token-file", a.verify_token_file]
        draft += ["--verify-auth-token-file", a.verify_token_file]
    if a.token_file:  # load tester -> draft
        draft += ["--auth-token-file", a.token_file]
        load += ["--token-file", a.token_file]
    abspath = lambda xs: [os.path.abspath(x) if i % 2 else x for i, x in enumerate(xs)]  # noqa: E731 - flag, path pairs
    return abspath(verify), abspath(draft), abspath(load)


def _raise_on_signal(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    loadtest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m bench.split", description=__doc__.split("\n\n")[0],
                                epilog="arguments after `--` are passed to bench.loadtest")
    p.add_argument("--target", help="target model directory (verify host)")
    p.add_argument("--draft", help="draft model directory (draft host)")
    p.add_argument("--rtt-ms", default="0", help="comma-separated round-trip times to add between draft and verify")
    p.add_argument("--always-proxy", action="store_true", help="route RTT 0 through the proxy as well (measures its overhead)")
    p.add_argument("--no-interleave", dest="interleave", action="store_false",
                   help="run all concurrency levels for one RTT before the next (default: alternate RTTs per level)")
    p.add_argument("--threads", default="1", help="torch threads per service (both share this machine's cores)")
    p.add_argument("--out", help="report directory (loadtest.json, REPORT.md, PNGs)")
    p.add_argument("--id", default=str(os.getpid()), help="suffix of the namespace and interface names")
    p.add_argument("--cleanup", action="store_true", help="only tear down the namespaces of run --id, then exit")
    p.add_argument("--verify-args", default="", help="extra verify_service arguments (one string)")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    c = p.add_argument_group("credentials (run the pair secured; files only)")
    for flag, what in (("tls-cert", f"server certificate of both services (SANs: 127.0.0.1 and {VERIFY_IP})"),
                       ("tls-key", "its private key"),
                       ("tls-ca", "the CA that signed the certificates (the draft and the load tester check servers with it)"),
                       ("tls-client-cert", "client certificate of the draft and the load tester: mTLS on both hops"),
                       ("tls-client-key", "its private key"),
                       ("verify-token-file", "session token: the verify service requires it, the draft sends it"),
                       ("token-file", "client token: the draft requires it, the load tester sends it")):
        c.add_argument("--" + flag, help=what)
    a = p.parse_args(argv)
    n = names(a.id)
    if a.cleanup:
        cleanup(n)
        return 0
    if not (a.target and a.draft and a.out):
        p.error("--target, --draft and --out are required")
    ok, why = netns_supported()
    if not ok:
        print(f"error: cannot create network namespaces: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_on_signal)  # so the finally below runs on SIGTERM too
    rtts = [float(x) for x in a.rtt_ms.split(",") if x.strip()]
    verify_creds, draft_creds, load_creds = credential_args(a)
    env = dict(ENV, OMP_NUM_THREADS=str(a.threads))
    in_draft, in_verify = ("ip", "netns", "exec", n["ns_draft"]), ("ip", "netns", "exec", n["ns_verify"])
    started: list[Service] = []
    rc = 0
    try:
        setup(n)
        print(f"[split] namespaces {n['ns_draft']} ({DRAFT_IP}) <-veth-> {n['ns_verify']} ({VERIFY_IP})", file=sys.stderr)
        verify = Service("verify_service", "--model", os.path.abspath(a.target), "--threads", a.threads, *verify_creds, *a.verify_args.split(),
                         host=VERIFY_IP, env=env, prefix=in_verify, timeout=a.start_timeout_s)
        started.append(verify)
        print(f"[split] verify_service on {verify.address} (verify host)", file=sys.stderr)
        setup_rows = [
            "topology=two network namespaces joined by a veth pair (draft host " + DRAFT_IP + ", verify host " + VERIFY_IP
            + "); client and draft on the draft host's loopback",
            "RTT injection=bench/proxy.py on the draft host (userspace TCP proxy, per-chunk deadlines); RTT 0 = direct"
            + (" (through the proxy with no delay)" if a.always_proxy else ""),
            f"target model={a.target}", f"draft model={a.draft}", f"threads per service={a.threads}",
            f"machine={os.cpu_count()} CPU cores shared by both services, the proxy and the load tester",
        ]
        drafts = {}  # rtt -> draft Service (one per RTT, all against the same verify service)

        def start_draft(rtt: float) -> Service:
            upstream, proxy = verify.address, None
            if rtt > 0 or a.always_proxy:
                proxy = Service("bench.proxy", "--target", verify.address, "--rtt-ms", f"{rtt:g}", host="127.0.0.1",
                                env=env, prefix=in_draft, timeout=30)
                started.append(proxy)
                upstream = proxy.address
            draft = Service("draft_service", "--model", os.path.abspath(a.draft), "--verify", upstream, "--threads", a.threads, *draft_creds,
                            host="127.0.0.1", env=env, prefix=in_draft, timeout=a.start_timeout_s)
            started.append(draft)
            print(f"[split] RTT {rtt:g} ms: draft_service on {draft.address} (draft host) -> "
                  f"{'proxy ' + proxy.address + ' -> ' if proxy else ''}{verify.address}", file=sys.stderr)
            return draft

        def load_test(rtt: float, extra: list[str], append: bool) -> None:
            nonlocal rc
            cmd = [*in_draft, sys.executable, "-m", "bench.loadtest", "--server", drafts[rtt].address, "--out",
                   os.path.abspath(a.out), "--tag", f"rtt_ms={rtt:g}", *[x for s in setup_rows for x in ("--setup", s)],
                   *load_creds, *loadtest_args, *extra] + (["--append"] if append else [])
            # from the caller's directory (relative --prompts paths), with the repository importable
            r = subprocess.run(cmd, env=dict(env, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))))
            if r.returncode != 0:
                print(f"[split] load test at RTT {rtt:g} ms exited {r.returncode}", file=sys.stderr)
                rc = rc or r.returncode

        levels = _option(loadtest_args, "--concurrency")
        if a.interleave and len(rtts) > 1 and levels and not _option(loadtest_args, "--rate"):
            # All drafts up at once; for each concurrency, every RTT back to back, so a slow spell
            # of a shared machine hits the RTTs alike instead of whichever ran last.
            for rtt in rtts:
                drafts[rtt] = start_draft(rtt)
            k, repeats = 0, int(_option(loadtest_args, "--repeats") or 1)
            for level in levels.split(","):
                for rtt in rtts:  # each its own load test: --pair-offset keeps a --baseline's order alternating across them
                    load_test(rtt, ["--concurrency", level, "--pair-offset", str(k * repeats)], append=k > 0)
                    k += 1
        else:
            for k, rtt in enumerate(rtts):
                drafts[rtt] = start_draft(rtt)
                load_test(rtt, [], append=k > 0)
                drafts[rtt].stop()
    except KeyboardInterrupt as e:
        print(f"[split] interrupted ({e}); tearing down", file=sys.stderr)
        rc = 130
    except Exception as e:  # noqa: BLE001 - report, then tear down in finally
        print(f"[split] error: {e}", file=sys.stderr)
        rc = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish tearing down whatever arrives now
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for s in reversed(started):
            try:
                s.stop(timeout=15)
            except Exception:  # noqa: BLE001
                pass
        cleanup(n)
        left = [ns for ns in (n["ns_draft"], n["ns_verify"]) if ns in ip("netns", "list", check=False).stdout.split()]
        print(f"[split] torn down{' (left: ' + ', '.join(left) + ')' if left else ''}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
