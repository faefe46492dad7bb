"""The worker's adapters: an LRU of `--max-cpu-loras` adapters read into host memory, and
the `--max-loras` device slots a step's adapters must sit in (least recently used evicted).

An adapter arrives by its LoRARequest: `add` (a front end's load, or a request's first
step) reads and checks it (formats/peft_adapter.py) without touching the slots, so a bad
adapter disturbs nothing running. A step's adapters are put into slots before its forward
pass; one evicted from the host cache is read again from its path.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from services.lora_request import LoRARequest
from worker_svc.formats.model_config import ModelConfig
from worker_svc.formats.peft_adapter import PeftAdapter, module_shapes, read_peft_adapter
from worker_svc.kernels.cpu import sgmv
from worker_svc.model.lora import LoraContext, LoraSlots, LoraStep


class LoraManager:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device, kernel: bool = False) -> None:
        """`kernel`: the deltas as Triton kernels (worker_svc/kernels/triton/sgmv.py); else, for
        float32 on CPU, as the C++ kernel where it builds (worker_svc/kernels/cpu/sgmv.py)."""
        self.model_config, self.max_rank, self.max_cpu_loras = config, max_rank, max_cpu_loras
        cpu_kernel = sgmv.load() if not kernel and device.type == "cpu" and dtype == torch.float32 else None
        self.context = LoraContext(LoraSlots(module_shapes(config), config.num_hidden_layers, max_loras, max_rank,
                                             dtype, device, transposed_b=cpu_kernel is not None), kernel, cpu_kernel)
        self._host: OrderedDict[int, PeftAdapter] = OrderedDict()  # by lora_int_id, least recent first
        self._requests: dict[int, LoRARequest] = {}  # every adapter added and not removed: where to read it again
        self._slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recent first
        self._free_slots = list(range(max_loras - 1, -1, -1))
        # add and remove come on the front end's threads, steps on the step thread; a step
        # holds it while it fills and reads the slots (and reads again what the host cache let go).
        self._lock = threading.RLock()

    def add(self, request: LoRARequest) -> None:
        """Reads and checks the adapter into the host cache; LoraAdapterError names what is wrong.
        Adding an id again is a no-op, as vLLM's add_lora."""
        with self._lock:
            if request.lora_int_id in self._host:
                self._host.move_to_end(request.lora_int_id)
                return
        adapter = read_peft_adapter(request.lora_path, self.model_config, self.max_rank)  # outside the lock: slow
        with self._lock:
            self._requests[request.lora_int_id] = request
            self._host[request.lora_int_id] = adapter
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)

    def remove(self, lora_int_id: int) -> bool:
        with self._lock:
            known = self._requests.pop(lora_int_id, None) is not None
            self._host.pop(lora_int_id, None)
            if (slot := self._slots.pop(lora_int_id, None)) is not None:
                self._free_slots.append(slot)
            return known

    def list_loras(self) -> list[int]:
        with self._lock:
            return list(self._requests)

    def step(self, request_loras: list[LoRARequest | None], counts: list[int],
             token_requests: torch.Tensor) -> LoraStep | None:
        """Puts this step's adapters in slots and groups its rows by them. `request_loras`
        and `counts`: each scheduled request's adapter and rows, in plan order;
        `token_requests` [T]: each row's request index (on the device)."""
        ids = {lora.lora_int_id: lora for lora in request_loras if lora is not None}
        if not ids:
            self.context.step = None
            return None
        with self._lock:
            if len(ids) > len(self._slots) + len(self._free_slots):
                raise RuntimeError(f"a step with {len(ids)} adapters, more than --max-loras: the scheduler's plan "
                                   "is wrong")
            for lora in ids.values():
                self._ensure_in_slot(lora, ids)
            slot_of_request = [self._slots[lora.lora_int_id] if lora is not None else -1 for lora in request_loras]
        slot_counts: dict[int, int] = {}
        for slot, count in zip(slot_of_request, counts):
            slot_counts[slot] = slot_counts.get(slot, 0) + count
        token_slots = torch.tensor(slot_of_request, dtype=torch.long).to(token_requests.device)[token_requests]
        self.context.step = LoraStep.of(token_slots, slot_counts, self.context.slots.ranks)
        return self.context.step

    def _ensure_in_slot(self, lora: LoRARequest, needed: dict[int, LoRARequest]) -> None:
        if lora.lora_int_id in self._slots:
            self._slots.move_to_end(lora.lora_int_id)
            return
        self.add(lora)  # read again if the host cache let it go, or first met in a request
        adapter = self._host[lora.lora_int_id]
        if not self._free_slots:
            victim = next(i for i in self._slots if i not in needed)
            self._free_slots.append(self._slots.pop(victim))
        slot = self._free_slots.pop()
        self._slots[lora.lora_int_id] = slot
        self.context.slots.write(slot, adapter.rank, adapter.scaling, adapter.weights)
