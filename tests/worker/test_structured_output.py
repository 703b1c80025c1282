"""The structured-output manager and the logits mask, on a tiny byte-level tokenizer.

The tokenizer has one token per byte (ids 0..255, in byte order) and an end token (256),
so the allowed tokens of a grammar can be stated exactly.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from inflight.sampling_params import SamplingParams, StructuredOutputsParams
from inflight.structured_output import StructuredOutputManager
from inflight.worker.structured_output import apply_token_bitmask, mask_constrained_rows

END = 256


def byte_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from inflight.model.gguf_tokenizer import byte_alphabet

    alphabet = byte_alphabet()
    core = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken("<end>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<end>")


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture
def manager(tokenizer):
    m = StructuredOutputManager(tokenizer, vocab_size=END + 1, eos_token_ids=(END,))
    yield m
    m.shutdown()


def allowed(manager: StructuredOutputManager, request_id: str) -> set[int]:
    bitmask, failed = manager.fill_bitmask([request_id])
    assert not failed, failed
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[0, : END + 1]
    return set(np.flatnonzero(bits).tolist())


def compiled(manager: StructuredOutputManager, *request_ids: str) -> None:
    while manager.has_pending():
        manager.wait_for_compile(timeout=10)
    for request_id in request_ids:
        assert manager.is_ready(_Req(request_id))


class _Req:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


def test_choice_masks_advance_with_each_token_and_finish(manager) -> None:
    manager.add_request("r", StructuredOutputsParams(choice=["ab", "cd"]))
    compiled(manager, "r")
    assert allowed(manager, "r") == {ord("a"), ord("c")}
    assert manager.accept_tokens({"r": ord("c")}) == (set(), {})
    assert allowed(manager, "r") == {ord("d")}
    finished, failed = manager.accept_tokens({"r": ord("d")})
    assert finished == {"r"} and not failed


TRICKY_CHOICES = ["a.b", "x|y", "(", "\\", "new\nline", "é", "👍 ok", "[", "{1}", "^$", "-",
                  "~", "&", "#", " sp ", "\t", '"q"', "/s/", "a*", "(?:x)"]


@pytest.mark.parametrize("index", range(len(TRICKY_CHOICES)))
def test_every_choice_is_followed_byte_for_byte(manager, index: int) -> None:
    """Each choice, metacharacters and control characters included, is accepted exactly;
    once it is complete only the end (or a longer choice) may follow."""
    manager.add_request("r", StructuredOutputsParams(choice=TRICKY_CHOICES))
    compiled(manager, "r")
    for byte in TRICKY_CHOICES[index].encode():
        assert byte in allowed(manager, "r")
        assert manager.accept_tokens({"r": byte}) in ((set(), {}), ({"r"}, {}))
    assert END in allowed(manager, "r") or manager.accept_tokens({"r": END})[0] == {"r"}


def test_thousands_of_choices(manager) -> None:
    # llguidance's own choice grammar stops at 2000 (one parser row each).
    choices = [f"c{i}" for i in range(5000)]
    manager.add_request("r", StructuredOutputsParams(choice=choices))
    compiled(manager, "r")
    assert allowed(manager, "r") == {ord("c")}
    for byte in b"c4999":
        assert not manager.accept_tokens({"r": byte})[1]
    assert allowed(manager, "r") == {END}


def test_a_grammar_too_complex_to_run_fails_every_time_with_a_short_message(manager) -> None:
    """A regex the lexer gives up on fails its request at the first step; the failed
    grammar leaves the cache, so the same constraint fails again (never an empty
    "stop"), and the message is llguidance's error without its grammar dump."""
    params = StructuredOutputsParams(regex="(a{1000}){1000}")
    for request_id in ("first", "second"):
        manager.add_request(request_id, params)
        compiled(manager, request_id)
        _, failed = manager.fill_bitmask([request_id])
        if not failed:
            finished, failed = manager.accept_tokens({request_id: ord("a")})
            assert not finished
        assert failed[request_id].startswith("structured outputs:")
        assert "too many expressions" in failed[request_id]
        assert len(failed[request_id]) < 600 and "<grammar>" not in failed[request_id]
        manager.free([request_id])
    assert manager.num_cached_grammars == 0


def test_regex_mask_and_a_rejected_token_fails_that_request(manager) -> None:
    manager.add_request("r", StructuredOutputsParams(regex="[0-9]+x"))
    compiled(manager, "r")
    assert allowed(manager, "r") == {ord(str(d)) for d in range(10)}
    manager.accept_tokens({"r": ord("7")})
    # now a digit, the final "x"; the end is not allowed yet
    assert allowed(manager, "r") == {ord(str(d)) for d in range(10)} | {ord("x")}
    finished, failed = manager.accept_tokens({"r": ord("y")})
    assert not finished and "rejected token" in failed["r"]


def test_one_compile_per_distinct_constraint(manager) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    reordered = {"properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "type": "object"}
    manager.add_request("x", StructuredOutputsParams(json=schema))
    manager.add_request("y", StructuredOutputsParams(json=reordered))
    manager.add_request("z", StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert manager.num_cached_grammars == 2
    compiled(manager, "x", "y", "z")
    # Each request advances its own copy of the shared compiled grammar.
    manager.accept_tokens({"x": ord("{")})
    assert ord("{") in allowed(manager, "y") and ord("{") not in allowed(manager, "x")
    manager.free(["x", "y", "z"])
    assert manager.num_requests == 0


def test_a_request_is_not_ready_while_its_grammar_compiles(manager, monkeypatch) -> None:
    gate = threading.Event()
    compile_now = manager._compile

    def held(params):
        assert gate.wait(timeout=60)
        return compile_now(params)

    monkeypatch.setattr(manager, "_compile", held)
    manager.add_request("slow", StructuredOutputsParams(regex="a"))
    assert not manager.is_ready(_Req("slow")) and manager.has_pending()
    assert manager.is_ready(_Req("unconstrained"))
    gate.set()
    compiled(manager, "slow")
    assert allowed(manager, "slow") == {ord("a")}


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(tokenizer) -> None:
    from helpers.tiny_model import make_tiny_tokenizer  # word-level: llguidance cannot use it

    bad = StructuredOutputManager(make_tiny_tokenizer(), vocab_size=512, eos_token_ids=(2,))
    bad.add_request("r", StructuredOutputsParams(regex="a"))
    compiled(bad, "r")
    bitmask, failed = bad.fill_bitmask(["r"])
    assert "structured outputs" in failed["r"] and (bitmask == -1).all()
    bad.shutdown()


def test_bitmask_sets_minus_inf_exactly_where_forbidden() -> None:
    torch.manual_seed(0)
    vocab = 70  # three 32-bit words, the last partly used
    logits = torch.randn(3, vocab)
    before = logits.clone()
    keep = [{0, 5, 31, 32, 69}, {1, 33, 64}]
    bitmask = np.zeros((2, 3), dtype=np.int32)
    for row, tokens in enumerate(keep):
        bits = np.zeros(96, dtype=np.uint8)
        bits[list(tokens)] = 1
        bitmask[row] = np.packbits(bits, bitorder="little").view(np.int32)
    apply_token_bitmask(logits, [0, 2], bitmask)
    for row, tokens in ((0, keep[0]), (2, keep[1])):
        finite = set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
        assert finite == tokens
        assert torch.equal(logits[row, sorted(tokens)], before[row, sorted(tokens)])
    assert torch.equal(logits[1], before[1])  # the unconstrained row is untouched


def test_unconstrained_rows_never_reach_the_manager() -> None:
    class Untouchable:
        def fill_bitmask(self, request_ids):
            raise AssertionError("no constrained row, no grammar work")

    logits = torch.randn(2, 10)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)]
    assert mask_constrained_rows(Untouchable(), logits, ["a", "b"], params) == {}  # type: ignore[arg-type]
    assert torch.equal(logits, before)
