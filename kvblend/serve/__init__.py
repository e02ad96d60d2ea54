"""`kvblend serve`: an OpenAI-compatible chat server over the kvblend pipeline.

    schema.py     request models (pydantic; OpenAI chat schema + the `kvblend` extension) and the error shape
    chunks.py     messages → (system prompt, client chunks, question); segments as the response reports them
    responses.py  completion, stream-chunk and models bodies, built from the `openai` package's types
    scheduler.py  continuous batching: the bounded queue, one model thread, batched decode steps with new
                  requests' fusion in slices between them, cancellation between steps
    metrics.py    Prometheus text exposition (prometheus_client, a registry per app)
    app.py        the routes (FastAPI), the disconnect watch, SSE streaming
    server.py     uvicorn: logs on stderr, graceful shutdown

Nothing here is imported by the CLI at start-up: `kvblend serve` imports
server.py inside the command, so `kvblend --help` never loads FastAPI or torch.
"""
