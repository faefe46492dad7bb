"""What the planner reads of the fleet (planner/fleet.py): with --prometheus-url, the
queries it sends a Prometheus (a small fake of its HTTP query API), and its answers
taken as the interval's p90s and request rate; each replica's pool, from its lease. The
gateways' /metrics path is exercised against real gateways in tests/system/test_migration.py."""
from __future__ import annotations

import json
import math
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from planner.fleet import FleetReader, home_of, parse_gateway_metrics, pool_of
from services.registry import Member, Registry

from servers import redis_url  # noqa: F401  (fixtures)

ANSWERS = {
    "histogram_quantile(0.9, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[30s])))": "0.75",
    "histogram_quantile(0.9, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket[30s])))": "NaN",
    "sum(rate(vllm:request_success_total[30s]))": "4.5",
    "sum(rate(vllm:generation_tokens_total[30s]))": "900",
}


@pytest.fixture
def prometheus():
    queries: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            url = urllib.parse.urlparse(self.path)
            query = urllib.parse.parse_qs(url.query)["query"][0]
            queries.append(query)
            value = ANSWERS.get(query)
            result = [] if value is None else [{"metric": {}, "value": [1733300000.0, value]}]
            body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()
            self.send_response(200 if url.path == "/api/v1/query" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/", queries
    server.shutdown()


def test_prometheus_is_asked_for_the_interval_s_p90s_and_rate(prometheus, redis_url):
    url, queries = prometheus
    reader = FleetReader(Registry(redis_url), prometheus_url=url)
    seen = reader.observe([], {"decode": 2}, now_s=100.0, window_s=30.0)
    assert queries == list(ANSWERS)
    # NaN (no observation in the window) is no p90, not a number to compare with a target.
    assert (seen.ttft_p90_s, seen.itl_p90_s, seen.request_rate, seen.generation_tokens_rate) == (0.75, None, 4.5, 900)
    assert seen.pools["decode"].replicas == 2 and seen.pools["decode"].serving == 0


def test_a_gateways_metrics_are_summed_by_bucket():
    text = """# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 3.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 5.0
vllm:time_to_first_token_seconds_count{model_name="m"} 5.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 1.5
# TYPE vllm:request_success counter
vllm:request_success_total{finished_reason="stop",model_name="m"} 4.0
vllm:request_success_total{finished_reason="length",model_name="m"} 2.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{model_name="m"} 120.0
vllm:generation_tokens_total{model_name="n"} 30.0
"""
    scrape = parse_gateway_metrics(text)
    assert scrape.ttft == {0.1: 3.0, math.inf: 5.0} and scrape.itl == {} and scrape.requests == 6.0
    assert scrape.generation_tokens == 150.0


def test_a_replicas_pool_is_its_kv_role_s_unless_it_was_given_one():
    def member(**metadata: str) -> Member:
        return Member("scheduler", "s", "10.0.0.1:50052", metadata)

    assert [pool_of(member(kv_role=role)) for role in ("kv_producer", "kv_consumer", "kv_both", "")] == [
        "prefill", "decode", "decode", "combined"]
    moved = member(kv_role="kv_both", kv_pool="decode", kv_home_pool="prefill")
    assert (pool_of(moved), home_of(moved)) == ("decode", "prefill")
    assert home_of(member(kv_role="kv_consumer")) == "decode"
