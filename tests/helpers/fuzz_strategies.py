"""Hypothesis strategies for fuzzing: junk values of every JSON and Python type, and
per-field mixes of plausible values and junk for ``SamplingParams``.

"Junk" covers what a careless or hostile client sends: huge and negative integers, NaN and
infinities, bools where numbers are expected, unicode with control characters and lone
surrogates, empty and long lists, and nested containers.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

INT64_MAX = 2**63 - 1

huge_ints = st.sampled_from([-(2**63) - 1, -(2**63), -1, 2**63 - 1, 2**63, 2**64, 10**30, 10**400])
any_ints = st.integers() | huge_ints
any_floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [float("nan"), float("inf"), float("-inf"), -0.0, 1e308, 5e-324]
)
# Any code point, control characters and lone surrogates included.
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=20)
scalars = st.none() | st.booleans() | any_ints | any_floats | any_text | st.binary(max_size=8)

# JSON-shaped junk, nested a few levels.
json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | any_text
json_junk = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=12,
)
junk = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(scalars, inner, max_size=4)
    | st.tuples(inner, inner)
    | st.frozensets(st.integers(), max_size=3),
    max_leaves=12,
)

small_token_ids = st.integers(0, 600)  # the tiny model's vocabulary is 512
stop_texts = st.text(st.characters(codec=None, exclude_categories=()), min_size=0, max_size=6)

plausible: dict[str, st.SearchStrategy[Any]] = {
    "n": st.integers(-2, 3),
    "temperature": st.floats(-1.0, 3.0) | any_floats,
    "top_p": st.floats(-0.5, 1.5) | any_floats,
    "top_k": st.integers(-3, 600) | st.none(),
    "min_p": st.floats(-0.5, 1.5),
    "seed": st.none() | any_ints,
    "max_tokens": st.none() | st.integers(-2, 4) | huge_ints,
    "min_tokens": st.integers(-2, 4) | huge_ints,
    "stop": st.none() | stop_texts | st.lists(stop_texts, max_size=4),
    "stop_token_ids": st.none() | st.lists(small_token_ids | any_ints, max_size=4),
    "ignore_eos": st.booleans(),
    "logprobs": st.none() | st.integers(-1, 30) | huge_ints,
    "prompt_logprobs": st.none() | st.integers(-1, 30) | huge_ints,
    "presence_penalty": st.floats(-3.0, 3.0) | any_floats,
    "frequency_penalty": st.floats(-3.0, 3.0) | any_floats,
    "repetition_penalty": st.floats(-1.0, 3.0) | any_floats,
    "logit_bias": st.none()
    | st.dictionaries(small_token_ids | any_text | any_floats | huge_ints, st.floats(-150, 150)),
    "allowed_token_ids": st.none() | st.lists(small_token_ids | any_ints, max_size=5)
    | st.lists(small_token_ids, min_size=500, max_size=600),
    "bad_words": st.none() | st.lists(stop_texts, max_size=3),
    "best_of": st.none() | st.integers(-1, 3),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "detokenize": st.booleans(),
    "structured_outputs": st.none()
    | st.fixed_dictionaries(
        {},
        optional={
            "regex": st.sampled_from(["w[0-9]+", "(w1|w2)", "[", "", "a{0,99999}"]) | any_text,
            "choice": st.lists(stop_texts, max_size=3) | any_text,
            "json": st.sampled_from(
                [{"type": "object"}, {"type": "integer"}, "{", "[1]", "[" * 5000, {}]
            ) | json_junk,
            "json_object": st.booleans() | st.integers(0, 1),
            "grammar": st.sampled_from(["start: \"w1\"", "root ::= \"w1\"", "start:", ""]),
            "disable_any_whitespace": st.booleans() | junk,
        },
    ),
}


def sampling_kwargs(with_junk: bool = True) -> st.SearchStrategy[dict[str, Any]]:
    """Keyword arguments for ``SamplingParams``: any subset of its fields, each either a
    plausible value or (when ``with_junk``) any junk at all."""
    fields = {
        name: (strategy | junk) if with_junk else strategy
        for name, strategy in plausible.items()
    }
    return st.fixed_dictionaries({}, optional=fields)


def _valid_structured() -> st.SearchStrategy[dict[str, Any]]:
    spec = st.one_of(
        st.builds(lambda r: {"regex": r}, st.sampled_from(["w[0-9]+", "(w1|w2)", "[", "a{0,9}"])),
        st.builds(lambda c: {"choice": c}, st.lists(st.sampled_from(["w1", "w2 w3"]), min_size=1)),
        st.builds(lambda j: {"json": j}, st.sampled_from([{"type": "object"}, {"type": "integer"}])),
        st.just({"json_object": True}),
        st.just({"grammar": 'start: "w1"'}),
    )
    return spec


def accepted_sampling_kwargs() -> st.SearchStrategy[dict[str, Any]]:
    """Keyword arguments ``SamplingParams`` accepts, at the edges of every range (token
    ids, logprob counts and bad words are checked later, by the engine, against the
    model: some of them are out of its vocabulary or limits on purpose)."""
    nonblank = stop_texts.filter(lambda s: s.strip() != "")
    fields: dict[str, st.SearchStrategy[Any]] = {
        "n": st.integers(1, 3),
        "temperature": st.floats(0.0, 2.0) | st.sampled_from([0.0, 1e-6, 1e30]),
        "top_p": st.floats(1e-9, 1.0),
        "top_k": st.integers(-1, 600) | st.just(INT64_MAX),
        "min_p": st.floats(0.0, 1.0),
        "seed": st.integers(-(2**63), INT64_MAX),
        "max_tokens": st.none() | st.integers(1, 4),
        "min_tokens": st.integers(0, 4),
        "stop": st.lists(stop_texts.filter(bool), max_size=3),
        "stop_token_ids": st.lists(small_token_ids | st.integers(0, INT64_MAX), max_size=3),
        "ignore_eos": st.booleans(),
        "logprobs": st.none() | st.integers(0, 30) | st.just(INT64_MAX),
        "prompt_logprobs": st.none() | st.integers(0, 30),
        "presence_penalty": st.floats(-2.0, 2.0),
        "frequency_penalty": st.floats(-2.0, 2.0),
        "repetition_penalty": st.floats(1e-6, 1e30),
        "logit_bias": st.dictionaries(small_token_ids, st.floats(-100.0, 100.0), max_size=5),
        "allowed_token_ids": st.lists(small_token_ids, min_size=1, max_size=5)
        | st.lists(small_token_ids, min_size=500, max_size=600),
        "bad_words": st.lists(nonblank, max_size=3),
        "skip_special_tokens": st.booleans(),
        "include_stop_str_in_output": st.booleans(),
        "structured_outputs": _valid_structured(),
    }
    return st.fixed_dictionaries({}, optional=fields)
