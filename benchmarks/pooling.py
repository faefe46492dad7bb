"""Embedding throughput: kvfleet's pooling runner vs. sentence-transformers' encode().

2,000 sentences of 5 to 120 words (drawn from tests/corpus.py's text with a fixed seed)
through all-MiniLM-L6-v2, first all at once through kvfleet's `LLM.embed` (the scheduler
packs them into steps by tokens, no padding), then through sentence-transformers'
`encode(batch_size=32)` (padded batches), one after the other in this process, on the
same torch threads; their vectors are compared too. With --itl, a second phase: one
greedy stream of the default model (which pools too, by a --pooler-config) alone, then
with embedding requests arriving beside it, and its inter-token latency in both. Writes
JSON (--out). The issue's targets: kvfleet at 1.5x sentence-transformers' sentences/s or
more; the stream's inter-token latency at most 25% higher beside the embeddings.
"""
from __future__ import annotations

import os

# Before torch loads OpenMP: idle threads sleep rather than spin on shared cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from corpus import TEXT  # noqa: E402

MODEL = "all-minilm-l6-v2"
TARGET_RATIO = 1.5
TARGET_ITL_RISE = 0.25
STREAM_TOKENS = 64


def sentences(count: int, seed: int) -> list[str]:
    words = TEXT.split()
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        length = rng.randint(5, 120)
        start = rng.randrange(len(words))
        out.append(" ".join(words[(start + i) % len(words)] for i in range(length)))
    return out


def stream_itl(llm, prompt: list[int], texts: list[str], every: int) -> list[float]:
    """Seconds between a greedy stream's tokens; with `texts`, 8 of them are added as
    embedding requests every `every` of its steps, beside it."""
    from kvfleet import PoolingParams, SamplingParams

    engine, tokenizer = llm.engine, llm.get_tokenizer()
    engine.add_request("stream", prompt, SamplingParams(temperature=0, max_tokens=STREAM_TOKENS, ignore_eos=True))
    gaps, last, step, pending = [], None, 0, list(texts)
    embed = SamplingParams(pooling=PoolingParams())
    while engine.has_work:
        if pending and step % every == 0:
            for i in range(min(8, len(pending))):
                engine.add_request(f"e{step}-{i}", tokenizer.encode(pending.pop()), embed)
        step += 1
        for delta in engine.step():
            if delta.request_id == "stream" and delta.new_token_ids:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return gaps


def itl_phase(texts: list[str]) -> dict:
    from kvfleet import LLM

    llm = LLM("smollm2", pooler_config='{"pooling_type": "LAST"}', max_num_batched_tokens=512)
    prompt = llm.get_tokenizer().encode(TEXT)[:64]
    stream_itl(llm, prompt, [], 1)  # warm-up
    alone = stream_itl(llm, prompt, [], 1)
    beside = stream_itl(llm, prompt, texts[:128], 4)
    mean_alone, mean_beside = sum(alone) / len(alone), sum(beside) / len(beside)
    return {"itl_alone_ms": round(1000 * mean_alone, 2), "itl_beside_embeddings_ms": round(1000 * mean_beside, 2),
            "itl_rise": round(mean_beside / mean_alone - 1, 3), "itl_target_rise": TARGET_ITL_RISE,
            "itl_max_num_batched_tokens": 512}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("KVFLEET_NUM_THREADS", "2")))
    parser.add_argument("--out", type=Path, default=Path("pooling.json"))
    parser.add_argument("--itl", action="store_true", help="also the stream's inter-token latency beside embeddings")
    parser.add_argument("--only-itl", action="store_true", help="the inter-token latency phase alone")
    args = parser.parse_args()
    os.environ["KVFLEET_NUM_THREADS"] = str(args.threads)  # what LLM() applies
    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    from kvfleet import LLM
    from services.model_source import resolve_model

    texts = sentences(args.sentences, seed=0)
    if args.only_itl:
        result = {"threads": args.threads, **itl_phase(texts), "load_average": os.getloadavg()}
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return
    llm = LLM(MODEL, max_num_batched_tokens=8192)
    llm.embed(texts[:64], use_tqdm=False)  # warm-up
    started = time.perf_counter()
    ours = llm.embed(texts, use_tqdm=False)
    kvfleet_s = time.perf_counter() - started
    reference = SentenceTransformer(str(resolve_model(MODEL).path), device="cpu")
    reference.encode(texts[:64], batch_size=32)  # warm-up
    started = time.perf_counter()
    theirs = reference.encode(texts, batch_size=32, convert_to_tensor=True)
    st_s = time.perf_counter() - started
    vectors = torch.tensor([o.outputs.embedding for o in ours])
    cosines = torch.nn.functional.cosine_similarity(vectors, theirs, dim=1)
    result = {
        "sentences": len(texts), "threads": args.threads,
        "tokens": sum(len(o.prompt_token_ids) for o in ours),
        "kvfleet_s": round(kvfleet_s, 3), "kvfleet_sentences_per_s": round(len(texts) / kvfleet_s, 1),
        "sentence_transformers_s": round(st_s, 3), "sentence_transformers_sentences_per_s": round(len(texts) / st_s, 1),
        "ratio": round(st_s / kvfleet_s, 3), "target_ratio": TARGET_RATIO,
        "min_cosine": round(cosines.min().item(), 6),
        **(itl_phase(texts) if args.itl else {}),
        "load_average": os.getloadavg(),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
