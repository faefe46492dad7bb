"""POST /score (/v1/score) and /rerank (/v1/rerank, /v2/rerank): vLLM's scoring APIs over
a cross-encoder or an embedding model (docs/pooling.md)."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway.context import GatewayContext, get_context
from gateway.disconnect import cancel_on_disconnect
from gateway.json_body import OffLoopJsonRoute
from gateway.pooling_protocol import (
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from gateway.scoring import score_pairs
from services.scoring import pair_lists

router = APIRouter(route_class=OffLoopJsonRoute)


@router.post("/score")
@router.post("/v1/score")
async def create_score(body: ScoreRequest, request: Request, ctx: GatewayContext = Depends(get_context)) -> Response:
    return await cancel_on_disconnect(request, _score(body, ctx))


async def _score(body: ScoreRequest, ctx: GatewayContext) -> Response:
    ctx.check_model(body.model)
    firsts, seconds = pair_lists(body.text_1, body.text_2)
    scores, tokens = await score_pairs(ctx, firsts, seconds, body.truncate_prompt_tokens, body.use_activation,
                                       "Score")
    response = ScoreResponse(model=ctx.served_model_name,
                             data=[ScoreData(index=i, score=score) for i, score in enumerate(scores)],
                             usage=PoolingUsage.of(tokens))
    return Response(response.model_dump_json(), media_type="application/json")


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def create_rerank(body: RerankRequest, request: Request, ctx: GatewayContext = Depends(get_context)) -> Response:
    return await cancel_on_disconnect(request, _rerank(body, ctx))


async def _rerank(body: RerankRequest, ctx: GatewayContext) -> Response:
    ctx.check_model(body.model)
    if not body.documents:
        return Response(RerankResponse(model=ctx.served_model_name, usage=RerankUsage(prompt_tokens=0, total_tokens=0),
                                       results=[]).model_dump_json(), media_type="application/json")
    scores, tokens = await score_pairs(ctx, [body.query] * len(body.documents), body.documents,
                                       body.truncate_prompt_tokens, body.use_activation, "Rerank")
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or None]
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=body.documents[i]) if body.return_documents else None)
               for i in ranked]
    response = RerankResponse(model=ctx.served_model_name, usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
                              results=results)
    return Response(response.model_dump_json(), media_type="application/json")
