"""Data-parallel serving: engine replicas in Ray actors behind one OpenAI endpoint.

``router`` (pure Python) picks a replica; ``replica`` is the Ray actor owning one engine;
``client`` is the engine client the server drives; ``metrics`` re-exports every replica's
metrics with a ``replica`` label. Nothing here imports ray until a client is built.
"""
