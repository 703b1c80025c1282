"""A tiny randomly initialised Llama, saved as a Hugging Face checkpoint directory."""

from __future__ import annotations

from pathlib import Path

VOCAB_SIZE = 512
EOS_TOKEN_ID = 2


def make_tiny_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, VOCAB_SIZE)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
    )


def write_tiny_llama(directory: Path, seed: int = 0, **overrides) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    options = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    )
    options.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**options)).eval()
    # Larger weights than the default init give peaked logits, so greedy ties are rare.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(directory, safe_serialization=True)
    make_tiny_tokenizer().save_pretrained(directory)
    return directory


def with_generation_config(source: Path, directory: Path, **fields) -> Path:
    """A copy of the checkpoint at ``source`` in ``directory`` whose
    generation_config.json also holds ``fields`` (sampling defaults, say)."""
    import json
    import shutil

    shutil.copytree(source, directory)
    path = directory / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    config.update(fields)
    path.write_text(json.dumps(config))
    return directory
