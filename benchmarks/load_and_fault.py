"""Load and faults: the cluster (`kvfleet cluster up`) never fails healthy work.

One cluster (smollm2, float32, one torch thread a role) is held under load for the whole
run by six "witness" threads, each looping over streamed chat completions of 32 tokens
(ignore_eos) through the official `openai` client; a witness request is OK when it ends
with finish_reason "length" and 32 completion tokens. Another thread sends, throughout,
a fixed list of hostile bodies (bad JSON, wrong types, out-of-range values, fan-out over
the bound, a 20 MB body, deep nesting...) to /v1/chat/completions, /v1/completions and
/tokenize, each of which must get a 4xx, and now and then heavy but valid requests
(beam search of width 16, n=16), which must get a 200. Meanwhile the cluster's children
are killed with SIGKILL one at a time, with steady load between: Redis (restarted
empty), the tokenizer, NATS, the worker and the scheduler; the launcher's supervisor
restarts each. A fault's recovery is timed to the first /health 200 once its
replacement process runs, and to the first probe request served after it.

Accounting. A failed witness or heavy request is "owned" by a fault, so acceptable,
only when it ended in an explicit error (not a hang) and either it was in flight at
the kill of the worker or the scheduler, the roles that hold a request's state (its
KV cache, its sequence), and still moving then (a token, or its start, within 30 s
before the kill), or it started after such a kill and before /health was 200 again.
Every other failure is "lost", whatever fault it came near: Redis, NATS and the
tokenizer hold no request state, so the cluster must ride through them. A tokenizer
kill should break at most the tokenizations in flight at that instant; even those
count as lost here, since the tokenizer is stateless and the call could be retried.
A request with no end within 120 s, or a read timeout, is a hang: always lost. The
recovery probes count too: each is sent only while /health is 200, so one that fails
is lost (as is one with no answer within 60 s).
A hostile body must get a 4xx; a 503 is excused only while a fault's recovery is under
way or /health is not 200 (the gateway checks readiness before a body's values), and
is listed apart; any other 5xx, or a dropped connection, counts against the run.
Exit code 0 when nothing was lost, every hostile body got a 4xx (or an excused 503),
every fault recovered, and the cluster stopped on SIGTERM with exit code 0 within 90 s.
Run with `--quick` for shorter steady periods (~4 minutes on 2 cores); JSON goes to
benchmarks/results/load_and_fault.json.
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai

from kvfleet.processes import free_port

MODEL = "smollm2"
REPO = Path(__file__).resolve().parents[1]  # the cluster runs this checkout's code
WITNESSES, WITNESS_TOKENS = 6, 32
HANG_S = 120.0  # a request with no end by then is a hang
PROBE_S = 60.0  # a one-token probe unanswered by then is a hang
STALL_S = 30.0  # no token for this long before a kill: stalled already, so not the kill's failure
STATEFUL = {"worker", "scheduler"}  # the roles that hold requests' state: their kills own what they had
FAULTS = ["redis", "tokenizer", "nats", "worker", "scheduler"]
FULL = {"warmup_s": 30.0, "steady_s": 20.0}
QUICK = {"warmup_s": 15.0, "steady_s": 10.0}  # about one witness request, at ~2 tokens/s a stream
CHAT, COMPLETIONS, TOKENIZE = "/v1/chat/completions", "/v1/completions", "/tokenize"
JSON_TYPE = "application/json"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def body(**fields: object) -> bytes:
    return json.dumps({"model": MODEL, **fields}).encode()  # ensure_ascii: "\ud800" travels as its escape


def chat(**fields: object) -> bytes:
    return body(messages=[{"role": "user", "content": "Hello"}], **fields)


def hostile_bodies() -> list[tuple[str, str, bytes, str]]:
    """(name, path, raw body, content type): each must be refused with a 4xx."""
    huge = b'{"model": "smollm2", "messages": [{"role": "user", "content": "' + b"a" * (20 * 2**20) + b'"}]}'
    nested = b'{"model": "smollm2", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return [
        ("chat: invalid JSON", CHAT, b"{model: smollm2, messages: [}", JSON_TYPE),
        ("chat: truncated JSON", CHAT, chat()[:-9], JSON_TYPE),
        ("chat: messages as a string", CHAT, body(messages="Hello"), JSON_TYPE),
        ("chat: max_tokens 'ten'", CHAT, chat(max_tokens="ten"), JSON_TYPE),
        ("chat: negative max_tokens", CHAT, chat(max_tokens=-5), JSON_TYPE),
        ("chat: huge max_tokens", CHAT, chat(max_tokens=10**12), JSON_TYPE),
        ("chat: temperature NaN", CHAT, chat()[:-1] + b', "temperature": NaN}', JSON_TYPE),  # raw NaN: not JSON
        ("chat: lone surrogate", CHAT, body(messages=[{"role": "user", "content": "\ud800"}]), JSON_TYPE),
        ("chat: invalid UTF-8", CHAT, chat().replace(b"Hello", b"\xff\xfe"), JSON_TYPE),
        ("chat: unknown model", CHAT, chat().replace(b"smollm2", b"no-such-model"), JSON_TYPE),
        ("chat: n=100000", CHAT, chat(n=100_000), JSON_TYPE),
        ("chat: top_logprobs 99", CHAT, chat(logprobs=True, top_logprobs=99), JSON_TYPE),
        ("chat: 20 MB body", CHAT, huge, JSON_TYPE),
        ("chat: empty body", CHAT, b"", JSON_TYPE),
        ("chat: text/plain", CHAT, chat(), "text/plain"),
        ("chat: deeply nested JSON", CHAT, nested, JSON_TYPE),
        ("completions: 64 prompts x n=8", COMPLETIONS, body(prompt=["Hi"] * 64, n=8, max_tokens=4), JSON_TYPE),
        ("completions: prompt as an object", COMPLETIONS, body(prompt={"text": "Hi"}), JSON_TYPE),
        ("completions: token id 2**40", COMPLETIONS, body(prompt=[2**40]), JSON_TYPE),
        ("completions: best_of < n", COMPLETIONS, body(prompt="Hi", n=4, best_of=2), JSON_TYPE),
        ("completions: truncated JSON", COMPLETIONS, body(prompt="Hi")[:-3], JSON_TYPE),
        ("tokenize: invalid JSON", TOKENIZE, b"{prompt: Hi}", JSON_TYPE),
        ("tokenize: lone surrogate", TOKENIZE, body(prompt="\ud800"), JSON_TYPE),
        ("tokenize: prompt as a number", TOKENIZE, body(prompt=12), JSON_TYPE),
        ("tokenize: unknown model", TOKENIZE, json.dumps({"model": "no-such-model", "prompt": "Hi"}).encode(), JSON_TYPE),
        ("tokenize: empty body", TOKENIZE, b"", JSON_TYPE),
    ]


# Valid but heavy: (name, path, body, choices expected); each must be served with a 200.
HEAVY = [("chat: beam search, best_of 16", CHAT, {"use_beam_search": True, "best_of": 16, "max_tokens": 6}, 1),
         ("chat: n=16", CHAT, {"n": 16, "max_tokens": 8, "temperature": 1.0}, 16)]


@dataclass
class Attempt:
    """One witness, heavy or probe request; times in seconds from the start of the run."""
    kind: str
    started: float
    ended: float | None = None
    tokens: int = 0  # content chunks received, then the usage's count once it arrives
    last_token: float | None = None
    finish_reason: str | None = None
    status: int | None = None  # an HTTP error's status
    error: str = ""
    ok: bool = False


@dataclass
class Fault:
    kind: str
    pid: int
    at: float
    health_back_at: float | None = None  # first /health 200 once the replacement runs
    served_at: float | None = None  # first probe served after that
    owned: int = 0
    lost: int = 0
    unhealthy_s: float = 0.0  # /health not 200, from the kill to the next fault (or the end)
    failures: Counter = field(default_factory=Counter)  # "verdict: kind: error" (request ids left out): count
    failed: list[dict] = field(default_factory=list)  # the failed requests themselves, the first 30


@dataclass
class Run:
    """What the threads share: the clock, the stop flag and everything they record."""
    url: str
    t0: float = field(default_factory=time.monotonic)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    attempts: list[Attempt] = field(default_factory=list)
    bodies: list[tuple[float, str, int, str]] = field(default_factory=list)  # (at, name, status, detail)
    health: list[tuple[float, int]] = field(default_factory=list)  # (at, status): 0 when unreachable

    def now(self) -> float:
        return time.monotonic() - self.t0

    def begin(self, kind: str) -> Attempt:
        attempt = Attempt(kind, self.now())
        with self.lock:
            self.attempts.append(attempt)
        return attempt


def health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code
    except httpx.HTTPError:
        return 0


def witness(run: Run, index: int) -> None:
    client = openai.OpenAI(base_url=f"{run.url}/v1", api_key="none", max_retries=0, timeout=HANG_S)
    turn = 0
    while not run.stop.is_set():
        turn += 1
        attempt = run.begin("witness")
        try:
            with client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"Count from {index * 1000 + turn} upwards."}],
                    max_tokens=WITNESS_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True}) as chunks:
                for chunk in chunks:
                    if chunk.usage is not None:
                        attempt.tokens = chunk.usage.completion_tokens
                    for choice in chunk.choices:
                        if choice.delta.content:  # so a stream that stalls shows how far it got, and when
                            attempt.tokens, attempt.last_token = attempt.tokens + 1, run.now()
                        attempt.finish_reason = choice.finish_reason or attempt.finish_reason
            attempt.ok = (attempt.finish_reason, attempt.tokens) == ("length", WITNESS_TOKENS)
            if not attempt.ok:
                attempt.error = f"stream ended with {attempt.tokens} tokens, finish_reason {attempt.finish_reason}"
        except Exception as exc:  # an error is a number in the report, never the end of the load
            attempt.status = getattr(exc, "status_code", None)
            attempt.error = f"{type(exc).__name__}: {exc}"[:400]
        attempt.ended = run.now()
        if not attempt.ok:
            run.stop.wait(1.0)  # as a client would: back off a little rather than spin on a 503


def send_heavy(run: Run) -> None:
    for name, path, fields, choices in HEAVY:
        attempt = run.begin("heavy")
        try:
            reply = httpx.post(f"{run.url}{path}", json={"model": MODEL, "messages": [
                {"role": "user", "content": "Name a color."}], **fields}, timeout=HANG_S)
            attempt.status = reply.status_code
            attempt.ok = reply.status_code == 200 and len(reply.json()["choices"]) == choices
            attempt.error = "" if attempt.ok else f"{name}: {reply.status_code} {reply.text[:300]}"
        except Exception as exc:
            attempt.error = f"{name}: {type(exc).__name__}: {exc}"[:400]
        attempt.ended = run.now()


def hostile(run: Run) -> None:
    """Hostile bodies in turn, then the heavy valid requests, until the run stops."""
    bodies = hostile_bodies()
    while not run.stop.is_set():
        for name, path, content, content_type in bodies:
            at = run.now()
            try:  # a connection per body: a dropped one can only be this body's
                reply = httpx.post(f"{run.url}{path}", content=content, headers={"content-type": content_type},
                                   timeout=HANG_S)
                status, detail = reply.status_code, reply.text[:300]
            except httpx.HTTPError as exc:
                status, detail = 0, f"{type(exc).__name__}: {exc}"[:300]
            with run.lock:
                run.bodies.append((at, name, status, detail))
            if run.stop.wait(0.3):
                return
        send_heavy(run)


def monitor(run: Run) -> None:
    while not run.stop.wait(0.2):
        status = health(run.url)
        with run.lock:
            run.health.append((run.now(), status))


def children(launcher: int) -> dict[str, int]:
    """The launcher's children by role, from /proc: pids change with every restart."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_text().split("\0")
        except (OSError, ValueError, IndexError):  # not a process, or it exited meanwhile
            continue
        if parent != launcher:
            continue
        program = Path(argv[0].split(" ")[0]).name  # Redis and Valkey rewrite argv[0] to "name host:port"
        role = argv[argv.index("kvfleet.cli") + 1] if "kvfleet.cli" in argv else program
        found["redis" if "redis" in role or "valkey" in role else "nats" if "nats" in role else role] = int(entry.name)
    return found


def probe(run: Run) -> bool:
    """A request through every role (a tokenization, then a one-token completion), recorded
    as the witnesses' are. Sent only once /health is 200 again, so by the rule a failed one is lost."""
    attempt = run.begin("probe")
    try:
        for path, fields in ((TOKENIZE, {"prompt": "Hi"}), (COMPLETIONS, {"prompt": "Hi", "max_tokens": 1})):
            reply = httpx.post(f"{run.url}{path}", json={"model": MODEL, **fields}, timeout=PROBE_S)
            attempt.status = reply.status_code
            if reply.status_code != 200:
                attempt.error = f"probe {path}: {reply.status_code} {reply.text[:300]}"
                break
        else:
            attempt.ok = True
    except httpx.HTTPError as exc:  # a timeout here is a hang
        attempt.error = f"probe: {type(exc).__name__}: {exc}"[:400]
    attempt.ended = run.now()
    return attempt.ok


def inject(run: Run, launcher: int, kind: str) -> Fault:
    pid = children(launcher)[kind]
    os.kill(pid, signal.SIGKILL)
    fault = Fault(kind, pid, run.now())
    log(f"killed {kind} (pid {pid}) at {fault.at:.1f} s")
    deadline = time.monotonic() + 300  # a worker loads its model again: up to a minute on this CPU
    while time.monotonic() < deadline and fault.served_at is None:
        replacement = children(launcher).get(kind)
        if replacement is not None and replacement != pid and health(run.url) == 200:
            fault.health_back_at = fault.health_back_at or run.now()
            if probe(run):
                fault.served_at = run.now()
            else:
                time.sleep(0.8)  # a failed probe is a lost request: one a second, not five
        time.sleep(0.2)
    log(f"{kind}: /health 200 after {since(fault.health_back_at, fault.at)} s, served after "
        f"{since(fault.served_at, fault.at)} s")
    return fault


def since(t: float | None, start: float) -> float | None:
    return None if t is None else round(t - start, 2)


def rounded(fields: dict) -> dict:
    return {key: round(value, 2) if isinstance(value, float) else value for key, value in fields.items()}


def classify(attempt: Attempt, faults: list[Fault]) -> str:
    """ok, owned or lost, by the rule in the module docstring."""
    if attempt.ok:
        return "ok"
    ended = attempt.ended
    if ended is None or ended - attempt.started > HANG_S or "Timeout" in attempt.error:
        return "lost"  # a hang: no fault may own it
    progress = attempt.last_token if attempt.last_token is not None else attempt.started
    for fault in faults:
        if fault.kind in STATEFUL:
            window_end = fault.health_back_at if fault.health_back_at is not None else math.inf
            if attempt.started <= fault.at <= ended and fault.at - progress < STALL_S:
                return "owned"
            if fault.at <= attempt.started <= window_end:
                return "owned"
    return "lost"


def near(t: float, faults: list[Fault]) -> Fault | None:
    """The last fault before `t`: the one whose aftermath `t` falls in."""
    before = [fault for fault in faults if fault.at <= t]
    return before[-1] if before else None


def account(run: Run, faults: list[Fault], end: float) -> dict:
    verdicts = [(attempt, classify(attempt, faults)) for attempt in run.attempts]
    for attempt, verdict in verdicts:  # each failure to the fault whose aftermath it ended in
        fault = near(attempt.ended if attempt.ended is not None else end, faults)
        if fault is not None and verdict in ("owned", "lost"):
            setattr(fault, verdict, getattr(fault, verdict) + 1)
            fault.failures[f"{verdict}: {attempt.kind}: {re.sub(r'(chatcmpl|cmpl)-[0-9a-f]+', '<id>', attempt.error)}"] += 1
            if len(fault.failed) < 30:
                fault.failed.append(rounded(asdict(attempt)) | {"verdict": verdict})
    times, statuses = [t for t, _ in run.health], [s for _, s in run.health]
    for i, fault in enumerate(faults):  # seconds of /health not 200 from each kill to the next one
        stop = faults[i + 1].at if i + 1 < len(faults) else end
        fault.unhealthy_s = round(sum(min(b, stop) - max(a, fault.at) for (a, s), (b, _) in
                                      zip(run.health, run.health[1:]) if s != 200 and a < stop and b > fault.at), 1)

    def recovering(t: float) -> bool:
        unhealthy = bool(times) and statuses[max(bisect.bisect_right(times, t) - 1, 0)] != 200
        return unhealthy or any(f.at <= t <= (f.served_at or math.inf) for f in faults)

    refused, excused, others = Counter(), [], []
    by_body: dict[str, Counter] = {}
    for at, name, status, detail in run.bodies:
        by_body.setdefault(name, Counter())[str(status)] += 1
        if 400 <= status < 500:
            refused[name] += 1
        elif status == 503 and recovering(at):
            excused.append({"at": round(at, 1), "body": name, "detail": detail})
        else:
            others.append({"at": round(at, 1), "body": name, "status": status, "detail": detail})

    def tally(kind: str) -> dict:
        mine = [(a, v) for a, v in verdicts if a.kind == kind]
        return {"started": len(mine), **{v: sum(1 for _, x in mine if x == v) for v in ("ok", "owned", "lost")},
                "tokens_received": sum(a.tokens for a, _ in mine)}

    lost = [a for a, v in verdicts if v == "lost"]
    return {
        "load": tally("witness") | {"witness_threads": WITNESSES, "tokens_per_request": WITNESS_TOKENS},
        "heavy_valid": tally("heavy"),
        "probes": tally("probe"),
        "bodies": {"tried": len(run.bodies), "4xx": sum(refused.values()), "excused_503": len(excused),
                   "other": len(others), "others": others[:20], "excused": excused[:20],
                   "by_body": {name: dict(c) for name, c in by_body.items()}},
        "lost": {"count": len(lost), "first": [rounded(asdict(a)) | {"near_fault": getattr(
            near(a.ended or end, faults), "kind", None)} for a in lost[:50]]},
    }


def start_cluster(port: int, log_file: object) -> subprocess.Popen:
    argv = [sys.executable, "-m", "kvfleet.cli", "cluster", "up", "--model", MODEL, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", str(512 * 2**20),
            "--lease-ttl", "3"]
    # One torch thread a role, and idle OpenMP threads that sleep: six processes share two cores.
    env = {**os.environ, "KVFLEET_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(REPO)}
    env.pop("KVFLEET_API_KEY", None)
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter steady periods")
    parser.add_argument("--skip-faults", default="", help=f"comma-separated, of {','.join(FAULTS)}")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/load_and_fault.json")
    args = parser.parse_args()
    plan, skipped = QUICK if args.quick else FULL, {name for name in args.skip_faults.split(",") if name}
    if skipped - set(FAULTS):
        parser.error(f"unknown faults: {sorted(skipped - set(FAULTS))}")
    start_load, port = loadavg(), free_port()
    log_file = tempfile.NamedTemporaryFile("w+", prefix="kvfleet-load-and-fault-", suffix=".log", delete=False)
    log(f"load average {start_load}; cluster log: {log_file.name}")
    launcher = start_cluster(port, log_file)
    run, faults, threads = Run(f"http://127.0.0.1:{port}"), [], []
    try:
        deadline = time.monotonic() + 300
        while health(run.url) != 200:
            if launcher.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the cluster is not serving (exit code {launcher.poll()})")
            time.sleep(0.5)
        log(f"serving after {run.now():.1f} s; roles {children(launcher.pid)}")
        run.t0 = time.monotonic()  # the run's clock starts with the load
        threads = [threading.Thread(target=witness, args=(run, i), daemon=True) for i in range(WITNESSES)]
        threads += [threading.Thread(target=target, args=(run,), daemon=True) for target in (hostile, monitor)]
        for thread in threads:
            thread.start()
        time.sleep(plan["warmup_s"])
        for kind in (kind for kind in FAULTS if kind not in skipped):
            faults.append(inject(run, launcher.pid, kind))
            time.sleep(plan["steady_s"])
    except BaseException:
        log_file.flush()
        log("run failed; cluster log tail:\n" + Path(log_file.name).read_text()[-3000:])
        raise
    finally:
        run.stop.set()
        end = run.now()
        for thread in threads:  # in-flight requests finish; a hung one is found by its missing end
            thread.join(max(0.0, HANG_S + 10 - (run.now() - end)))
        began = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        try:
            exit_code = launcher.wait(90)
        except subprocess.TimeoutExpired:
            launcher.kill()
            exit_code = None
        shutdown = {"exit_code": exit_code, "seconds": round(time.monotonic() - began, 1)}
        log_file.close()
        log(f"cluster stopped: {shutdown}")
    result = {"duration_s": round(end, 1), "quick": args.quick, "plan": plan, "cluster_log": log_file.name,
              **account(run, faults, end),
              "faults": [rounded(asdict(f)) | {"recovery_s": since(f.health_back_at, f.at),
                                               "served_s": since(f.served_at, f.at),
                                               "failures": dict(f.failures.most_common())} for f in faults],
              "shutdown": shutdown, "loadavg": {"start": start_load, "end": loadavg()}}
    result["passed"] = (result["lost"]["count"] == 0 and result["bodies"]["other"] == 0
                        and all(f["served_at"] is not None for f in result["faults"]) and exit_code == 0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {key: result[key] for key in ("duration_s", "load", "heavy_valid", "probes", "shutdown", "loadavg",
                                            "passed")}
    summary["bodies"] = {k: result["bodies"][k] for k in ("tried", "4xx", "excused_503", "other")}
    summary["faults"] = [{k: f[k] for k in ("kind", "at", "recovery_s", "served_s", "owned", "lost", "unhealthy_s")}
                         for f in result["faults"]]
    summary["lost"] = result["lost"]["count"]
    print(json.dumps(summary, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
