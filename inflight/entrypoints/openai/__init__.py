"""The OpenAI-compatible server.

protocol.py            request/response bodies (pydantic), OpenAI fields + vLLM extras
errors.py              OpenAI's error object and status for every failure
params.py              request -> SamplingParams; refusing what the engine lacks
serving.py             shared plumbing: state, engine requests, SSE, disconnects
serving_completions.py POST /v1/completions
serving_chat.py        POST /v1/chat/completions
api_server.py          the app, its other routes, auth, and the uvicorn lifecycle
"""
