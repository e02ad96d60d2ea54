"""`kvblend serve`: an OpenAI-compatible chat server over the kvblend pipeline.

    schema.py     request models (pydantic; OpenAI chat schema + the `kvblend` extension) and the error shape
    chunks.py     messages → (system prompt, client chunks, question); segments as the response reports them
    responses.py  completion, stream-chunk and models bodies, built from the `openai` package's types
    mapping.py    a request → the pipeline's QueryOptions and each choice's OutputParams
    scheduler.py  continuous batching's policy: request states (RequestStatus), the bounded queue, admission,
                  the prefill budget; schedule() decides, update() applies what the executor did
    executor.py   the model work a decision asks for: new requests' fusion in slices, first tokens, one
                  batched decode step (kvblend.generation.step), answers
    engine_core.py  the model thread (schedule → execute → update) and what the routes call
    async_bridge.py  a request's Job: events from the model thread to the event loop, and its cancel switch
    metrics.py    Prometheus text exposition (prometheus_client, a registry per app)
    app.py        the routes (FastAPI), the disconnect watch, SSE streaming
    server.py     uvicorn: logs on stderr, graceful shutdown

Nothing here is imported by the CLI at start-up: `kvblend serve` imports
server.py inside the command, so `kvblend --help` never loads FastAPI or torch.
"""
