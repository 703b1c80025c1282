"""Raw prompts for the default model's precision tests (bf16 weights, int8 KV cache)."""

PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time, there was a",
    "The three primary colours are",
    "import numpy as np\n",
    "Water boils at a temperature of",
]
