"""What checking revocations costs: appends/s with it off and on, in one run, and the
storage requests it makes when nobody revokes anything.

1. Appends. For each rep, one fresh PicoMQ per side (one gevent worker pinned to the
   server core, a new data directory, tokens on), the sides alternated rep by rep; wrk
   on the client core POSTs one 100-byte JSON message per request to one stream over 64
   connections, each with a bearer token (compare.py's appends-1 load). The sides:
   `off` (PICOMQ_REVOCATION_INTERVAL=0), `on` (the default 5 s, nothing revoked) and
   `on, 1,000 revoked` (1,000 revocations of other tokens on storage, so each append's
   token is looked up). Prints, for each rep and as medians with on ÷ off: messages/s,
   and messages per second of the server's CPU time. The second is the one to compare
   when other work shares the machine: it does not count the time the worker waited for
   its core.
2. The check alone, in this process: the time `Verifier.claims_of` takes for one token
   (signature, claims, and the revocation check of each side), CHECKS in a row, the
   sides alternated, 10 rounds a rep; the part of an append's CPU time that revocation
   can change. Prints the fastest round of each side (least disturbed by other work)
   and the median.
3. Storage requests, on moto: one PicoMQ (one worker, the default interval) and, for
   `--s3-seconds` each, (a) a HEAD with a token every 0.2 s, (b) one SSE read of a token
   open and nothing else, (c) nothing at all. Counts the requests moto logs for the
   revocations/ prefix and prints them per hour.

Everything listens on 127.0.0.1 and stops by itself (wrk by `--duration`, at most 30 s;
each phase by `--s3-seconds`, at most 120 s); asserts nothing.

    .venv/bin/python bench/revocation.py                 # about 3 minutes
    .venv/bin/python bench/revocation.py --reps 5 --duration 5 --s3-seconds 60   # about 6
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

import jwt
import requests
import servers
from loads import (
    S3_BUCKET,
    S3_ENVIRONMENT,
    STREAM_PREFIX,
    Options,
    Posts,
    Target,
    message,
    wrk_load,
)

sys.path.insert(0, str(servers.REPO_DIR))  # the layout of revocations/ is the server's own
from auth import Verifier  # noqa: E402
from localdisk import LocalDisk  # noqa: E402
from revocations import PREFIX, Revocation, Revocations, digest_of  # noqa: E402
from settings import Settings  # noqa: E402

SECRET = "bench-revocation-secret-" + "b" * 40
SIDES = {
    "off": {"PICOMQ_REVOCATION_INTERVAL": "0"},
    "on": {},
    "on, 1,000 revoked": {},
}
REVOKED = 1000
CHECKS = 2_000  # token checks timed in a row, per side and round
ROUNDS_PER_REP = 10
STREAM = f"{STREAM_PREFIX}s0"
PROBE_INTERVAL_SECONDS = 0.2
MAX_S3_SECONDS = 120
# The S3 server's live reads: one SSE response through every phase, and a closed one
# noticed within 2 s, so that past SETTLE_SECONDS (that plus one 5 s interval, and a
# second) the phase before no longer lists.
LIVE_READ_SETTINGS = {"PICOMQ_SSE_MAX_DURATION": "600", "PICOMQ_LONG_POLL_TIMEOUT": "2"}
SETTLE_SECONDS = 8
REQUEST_TIMEOUT_SECONDS = 10


def mint(jti: str) -> str:
    now = int(time.time())
    claims = {"scope": "read:** append:** create:**", "iat": now, "exp": now + 3600, "jti": jti}
    return jwt.encode(claims, SECRET, algorithm="HS256")


def store_revocations(data_dir: Path, count: int) -> None:
    """`count` revocations of other tokens, written where the server keeps them."""
    folder = data_dir / PREFIX
    folder.mkdir(parents=True, exist_ok=True)
    now = int(time.time())
    for number in range(count):
        revocation = Revocation("jti", digest_of(f"revoked-{number}"), now + 3600, now)
        (folder / revocation.name).write_bytes(b"{}")


def append_rep(side: str, work_dir: Path, arguments: argparse.Namespace) -> tuple[float, float]:
    """Messages/s, and messages per server CPU-second, of one wrk run against a fresh
    server of `side`."""
    if side.endswith("revoked"):
        store_revocations(work_dir / "data", REVOKED)
    environment = {"PICOMQ_JWT_SECRET": SECRET, **SIDES[side]}
    server = servers.picomq(work_dir, arguments.server_core, environment).start()
    try:
        token = mint("bench-appender")
        url = f"{server.url}{STREAM}"
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
        requests.put(url, headers=headers, timeout=REQUEST_TIMEOUT_SECONDS).raise_for_status()
        options = Options(duration=arguments.duration, client_core=arguments.client_core)
        result = wrk_load(
            Target(server, work_dir), options, Posts(message(), 1, 1, 64, token=token)
        )
        for note in result.notes:
            print(f"  {side}: {note}")
        rate = result.figures["msgs_per_s"]
        return rate, rate / (result.figures["server_cpu_pct"] / 100)
    finally:
        server.stop()


def measure_appends(arguments: argparse.Namespace, base: Path) -> None:
    rates: dict[str, list[float]] = {side: [] for side in SIDES}
    per_cpu: dict[str, list[float]] = {side: [] for side in SIDES}
    for rep in range(arguments.reps):
        order = list(SIDES) if rep % 2 == 0 else list(reversed(SIDES))
        for side in order:
            work_dir = base / f"appends-{rep}-{list(SIDES).index(side)}"
            rate, rate_per_cpu = append_rep(side, work_dir, arguments)
            rates[side].append(rate)
            per_cpu[side].append(rate_per_cpu)
            print(
                f"rep {rep + 1}, {side}: {rate:,.0f} messages/s,"
                f" {rate_per_cpu:,.0f} per server CPU-second",
                flush=True,
            )
    print_medians("messages/s", rates)
    print_medians("messages per server CPU-second", per_cpu)


def print_medians(unit: str, values_of: dict[str, list[float]]) -> None:
    off = statistics.median(values_of["off"])
    for side, values in values_of.items():
        median = statistics.median(values)
        spread = f"{min(values):,.0f}–{max(values):,.0f}"
        print(f"{side:>18}: median {median:,.0f} {unit} ({spread}), {median / off:.3f} × off")


def measure_checks(arguments: argparse.Namespace, base: Path) -> None:
    settings = Settings.from_environment({"PICOMQ_JWT_SECRET": SECRET})
    verifiers = {}
    for number, side in enumerate(SIDES):
        revocations = None
        if side != "off":
            data_dir = base / f"checks-{number}"
            if side.endswith("revoked"):
                store_revocations(data_dir, REVOKED)
            revocations = Revocations(LocalDisk(str(data_dir)), interval=3600, grace_seconds=30)
        verifiers[side] = Verifier.from_settings(settings, revocations)
    token = mint("bench-checked")
    micros: dict[str, list[float]] = {side: [] for side in SIDES}
    for round_number in range(arguments.reps * ROUNDS_PER_REP):
        for side in SIDES if round_number % 2 == 0 else reversed(SIDES):
            verifier = verifiers[side]
            started = time.perf_counter()
            for _ in range(CHECKS):
                verifier.claims_of(token)
            micros[side].append((time.perf_counter() - started) / CHECKS * 1e6)
    fastest_off = min(micros["off"])
    for side, values in micros.items():
        fastest, median = min(values), statistics.median(values)
        print(
            f"{side:>18}: fastest {fastest:.2f} µs a token check ({fastest - fastest_off:+.2f}"
            f" against off), median {median:.2f} µs"
        )


def revocation_requests(moto: servers.Server, start: int) -> Counter[str]:
    """The requests moto logged on revocations/ after byte `start`, by method."""
    with moto.log_path.open("rb") as log:
        log.seek(start)
        text = log.read()
    counts: Counter[str] = Counter()
    for match in servers.S3_REQUEST_LINE.finditer(text):
        if PREFIX.encode() in match[2]:
            counts[match[1].decode()] += 1
    return counts


def measure_storage_requests(arguments: argparse.Namespace, base: Path) -> None:
    moto = servers.moto(base / "moto")
    (base / "moto").mkdir(parents=True)
    moto.start()
    server = None
    try:
        requests.put(f"{moto.url}/{S3_BUCKET}", timeout=REQUEST_TIMEOUT_SECONDS).raise_for_status()
        environment = {
            **S3_ENVIRONMENT,
            "AWS_ENDPOINT_URL": moto.url,
            "PICOMQ_STORAGE_URL": f"s3://{S3_BUCKET}/picomq",
            "PICOMQ_JWT_SECRET": SECRET,
            **LIVE_READ_SETTINGS,
        }
        server = servers.picomq(base / "s3", arguments.server_core, environment).start()
        token = mint("bench-reader")
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        url = f"{server.url}{STREAM}"
        requests.put(url, headers=headers, timeout=REQUEST_TIMEOUT_SECONDS).raise_for_status()
        seconds = arguments.s3_seconds
        phases = {
            "a HEAD with a token every 0.2 s": lambda: probe(url, headers, seconds),
            "one SSE read open, nothing else": lambda: hold_sse(url, headers, seconds),
            "no requests": lambda: time.sleep(seconds),
        }
        for name, run in phases.items():
            time.sleep(SETTLE_SECONDS)
            mark = moto.log_path.stat().st_size
            run()
            counts = revocation_requests(moto, mark)
            per_hour = sum(counts.values()) * 3600 / seconds
            print(f"{name:>32}: {dict(counts)} in {seconds} s, {per_hour:,.0f} an hour")
    finally:
        if server is not None:
            server.stop()
        moto.stop()


def probe(url: str, headers: dict[str, str], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    with requests.Session() as session:
        while time.monotonic() < deadline:
            session.head(url, headers=headers, timeout=REQUEST_TIMEOUT_SECONDS)
            time.sleep(PROBE_INTERVAL_SECONDS)


def hold_sse(url: str, headers: dict[str, str], seconds: float) -> None:
    """One SSE read held open for `seconds`, then closed by this client (the server
    notices at its next control event, within PICOMQ_LONG_POLL_TIMEOUT)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(
        parts.hostname, parts.port, timeout=REQUEST_TIMEOUT_SECONDS
    )
    try:
        connection.request("GET", f"{parts.path}?offset=now&live=sse", headers=headers)
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"the SSE read answered {response.status}")
        time.sleep(seconds)
    finally:
        connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--duration", type=int, default=5, help="seconds of wrk (at most 30)")
    parser.add_argument("--s3-seconds", type=int, default=20, help="seconds of each S3 phase")
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    parser.add_argument("--skip-s3", action="store_true")
    arguments = parser.parse_args()
    if not 1 <= arguments.duration <= 30 or not 1 <= arguments.s3_seconds <= MAX_S3_SECONDS:
        parser.error(f"--duration is 1–30 s, --s3-seconds 1–{MAX_S3_SECONDS} s")
    with tempfile.TemporaryDirectory(prefix="picomq-revocation-") as directory:
        base = Path(directory)
        measure_appends(arguments, base)
        measure_checks(arguments, base)
        if not arguments.skip_s3:
            measure_storage_requests(arguments, base)


if __name__ == "__main__":
    main()
