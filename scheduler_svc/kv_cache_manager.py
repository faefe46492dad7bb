"""A request's KV blocks in the device pool (vLLM's KVCacheManager): its longest cached
prefix, the blocks it takes to start from there and to grow, the indexing of its blocks
in the prefix cache once computed (and their saving to the offload tiers), its block
hashes, and the prefix-cache lookups' token counts that EngineStats reports."""
from __future__ import annotations

from scheduler_svc.block_pool import BlockPool, StoredBlock
from scheduler_svc.kv_connector import KvConnector
from scheduler_svc.request import Request
from scheduler_svc.scheduler_config import SchedulerConfig
from services.block_hash import extend_block_hashes, extra_keys_bytes
from services.speculative_config import WORKER_METHODS


class KvCacheManager:
    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, connector: KvConnector | None) -> None:
        self.config = config
        self.block_pool = block_pool
        self.connector = connector
        self.queries = 0  # tokens looked up
        self.hits = 0  # tokens found
        # A draft model or EAGLE head writes its drafts' KV after the step: slots for them.
        spec = config.speculative
        self.lookahead = spec.num_speculative_tokens if spec is not None and spec.method in WORKER_METHODS else 0

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The device blocks of the request's longest cached prefix."""
        # Prompt logprobs need every prompt position computed, cached or not.
        if not self.config.enable_prefix_caching or self.needs_every_position(request):
            return []
        self.hash_blocks(request)
        return self.block_pool.lookup(request.block_hashes[:self.max_hit_blocks(request)])

    def max_hit_blocks(self, request: Request) -> int:
        """The most blocks of the request a cache may give: at least one token must be
        computed, to get logits for the next one."""
        return (request.num_tokens - 1) // self.config.block_size

    def start_from_prefix(self, request: Request, hits: list[int], num_tokens: int) -> bool:
        """Take blocks for a request starting (or restarting) from its cached prefix `hits`
        with `num_tokens` more to compute; False when the pool is short."""
        num_computed = len(hits) * self.config.block_size
        if not self.take_blocks(request, hits, self._blocks_for(num_computed + num_tokens) - len(hits)):
            return False
        if request.num_cached_tokens is None:  # a preempted request's later hits are its own blocks
            request.num_cached_tokens = num_computed
        self.count(request, num_computed)
        return True

    def take_blocks(self, request: Request, hits: list[int], num_new: int) -> bool:
        """Give the request its cached prefix `hits`, as computed, and `num_new` free blocks
        after them; False when the pool is short."""
        if num_new > self.block_pool.num_free_blocks - self.block_pool.num_unheld(hits):
            return False
        self.block_pool.share(hits)
        request.block_ids = hits + self.block_pool.allocate(num_new)
        request.num_computed_tokens = len(hits) * self.config.block_size
        request.num_cached_blocks = len(hits)
        return True

    def allocate_slots(self, request: Request, num_tokens: int) -> list[int] | None:
        """Blocks for KV of `num_tokens` tokens in all (the new blocks), or None when the pool is short."""
        missing = self._blocks_for(num_tokens) - len(request.block_ids)
        if missing <= 0:
            return []
        if missing > self.block_pool.num_free_blocks:
            return None
        new_blocks = self.block_pool.allocate(missing)
        request.block_ids.extend(new_blocks)
        return new_blocks

    def _blocks_for(self, num_tokens: int) -> int:
        """Blocks a request holding KV of `num_tokens` tokens needs; with a draft model, also
        for its lookahead slots, where the drafts' KV is written after the step."""
        return -(-min(num_tokens + self.lookahead, self.config.max_model_len) // self.config.block_size)

    def count(self, request: Request, num_hit_tokens: int) -> None:
        """A request starts from `num_hit_tokens` tokens found in the device pool."""
        if self.config.enable_prefix_caching:
            self.queries += request.num_tokens
            self.hits += num_hit_tokens

    def needs_every_position(self, request: Request) -> bool:
        """Prompt logprobs, and pooling other than LAST (MEAN, CLS), read every prompt
        position's output: a cached prefix has none to give."""
        return request.sampling_params.prompt_logprobs is not None or (
            request.sampling_params.pooling is not None and self.config.pooler.pooling_type != "LAST")

    def hash_blocks(self, request: Request) -> None:
        """Hash the request's full blocks not hashed yet."""
        extra = extra_keys_bytes(cache_salt=request.cache_salt, lora_id=request.lora_int_id)
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.config.block_size, extra)

    def cache_computed(self, request: Request) -> None:
        """Index the blocks whose tokens are now all computed, and save them to the offload tiers."""
        # Only blocks of its tokens: a speculative step's accepted drafts count as computed
        # before they are appended to its output.
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.config.block_size
        if num_full <= request.num_cached_blocks:
            return
        self.hash_blocks(request)
        self.index(request, num_full, save=True)

    def index(self, request: Request, end: int, save: bool) -> None:
        """Index the request's blocks from its last indexed one up to `end` in the prefix
        cache; with `save`, the connector saves them to the tiers lacking them."""
        size, hashes = self.config.block_size, request.block_hashes
        tokens = request.all_token_ids if self.block_pool.events is not None else None  # for KV events only
        for index in range(request.num_cached_blocks, end):
            stored = None if tokens is None else StoredBlock(
                hashes[index - 1] if index else None, tokens[index * size:(index + 1) * size], request.cache_salt,
                request.lora_int_id, request.lora_request.lora_name if request.lora_request is not None else None)
            self.block_pool.cache(request.block_ids[index], hashes[index], stored)
            if save and self.connector is not None:
                self.connector.computed(request.block_ids[index], hashes[index])
        request.num_cached_blocks = end
