"""The KV offload tiers behind the OpenAI API, in both modes (`kvfleet serve` and
`cluster up`): a long prompt pushed out of a 64-block pool by others comes back from
the disk tier, with the same text, `usage.prompt_tokens_details.cached_tokens` counting
the loaded tokens, and the tier's metrics saying so."""
from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from openai_servers import API_KEY, MODES, SERVED, Server, running_server

from corpus import TEXT

PARAGRAPHS = TEXT.split("\n\n")


def long_prompt(index: int) -> str:
    """About 450 tokens: the paragraphs in another order each time, so no two share a
    block after the chat template's head."""
    return "\n\n".join(PARAGRAPHS[index:] + PARAGRAPHS[:index])[:1900]


@pytest.fixture(scope="module", params=MODES)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("kv-tiers")
    with running_server(request.param, tmp_path_factory, "--num-gpu-blocks-override", "64", "--kv-offloading-dir",
                        str(directory), "--enable-prompt-tokens-details") as running:
        yield running


def complete(client: openai.OpenAI, prompt: str) -> tuple[str, int, int]:
    """The text, the prompt's tokens, and those of them the cache supplied."""
    answer = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=8, temperature=0)
    usage = answer.usage
    return answer.choices[0].message.content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def test_a_prompt_pushed_out_of_the_pool_comes_back_from_disk(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    text, prompt_tokens, cached = complete(client, long_prompt(0))
    assert cached == 0
    for index in (1, 2, 3):  # 3 x 28 blocks: the first prompt's blocks leave the 64-block pool
        complete(client, long_prompt(index))
    again, _, cached = complete(client, long_prompt(0))
    assert again == text
    assert cached == (prompt_tokens - 1) // 16 * 16  # every full block but the one with the last token
    loaded = "kvfleet:kv_offload_loaded_blocks_total{medium=DISK}"
    metrics = server.metrics()  # a scrape sees every request that finished before it
    # The chat template's head is a block or more every prompt shares: those stay in the pool.
    assert 0 < metrics[loaded] * 16 == metrics["vllm:external_prefix_cache_hits_total"] <= cached
