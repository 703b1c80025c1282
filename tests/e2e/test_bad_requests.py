"""Bad requests raise clear errors and never disturb the requests already running."""

from __future__ import annotations

import pytest

from inflight import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
GOOD_PROMPTS = [[5, 6, 7, 8], [100, 200, 300], list(range(10, 60))]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_model_len=128, max_num_seqs=4)


@pytest.fixture(scope="module")
def expected(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in GOOD_PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


BAD_REQUESTS = {
    "empty prompt": ({"prompt_token_ids": []}, GREEDY, "empty"),
    "prompt over max_model_len": ({"prompt_token_ids": [5] * 129}, GREEDY, "max_model_len"),
    "token id outside vocabulary": ({"prompt_token_ids": [5, 99999]}, GREEDY, "vocabulary"),
    "not a prompt": (3.5, GREEDY, "prompt"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_rejected_while_others_run(llm, expected, case):
    engine = llm.llm_engine
    for i, prompt in enumerate(GOOD_PROMPTS):
        engine.add_request(f"good-{case}-{i}", {"prompt_token_ids": prompt}, GREEDY)
    engine.step()  # the good requests are mid-flight

    prompt, params, message = BAD_REQUESTS[case]
    with pytest.raises((ValueError, TypeError), match=message):
        engine.add_request(f"bad-{case}", prompt, params)

    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out.outputs[0].token_ids
    assert [finished[f"good-{case}-{i}"] for i in range(len(GOOD_PROMPTS))] == expected
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(bogus_field=1), "unknown sampling field"),
        (dict(n=0), "n must be a positive integer"),
        (dict(max_tokens=0, n=2), "0 only with prompt_logprobs"),
    ],
)
def test_bad_sampling_params_raise(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(options)


def test_generate_rejects_whole_call_without_running_any(llm, expected):
    prompts = [{"prompt_token_ids": GOOD_PROMPTS[0]}, {"prompt_token_ids": [5] * 500}]
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    # and the engine still serves
    outs = llm.generate([{"prompt_token_ids": p} for p in GOOD_PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize(
    ("last_prompt", "last", "message"),
    [
        ([5, 6], SamplingParams(max_tokens=4, logprobs=30), "max allowed: 20"),
        ([5, 6], SamplingParams(max_tokens=4, allowed_token_ids=[10**6]), "allowed_token_ids"),
        ([5, 6], SamplingParams(max_tokens=4, logit_bias={10**6: 1.0}), "logit_bias"),
        ([5] * 200, GREEDY, "maximum context length is 128 tokens"),
    ],
    ids=["logprobs over max_logprobs", "allowed id out of vocabulary",
         "bias id out of vocabulary", "prompt over max_model_len"],
)
def test_a_fed_batch_is_checked_whole_before_any_work(tiny_llama_dir, last_prompt, last, message):
    """With max_waiting_requests the call feeds its prompts as room frees; a bad one at
    the end must still fail the call before the first step, not after the others ran."""
    llm = LLM(str(tiny_llama_dir), max_model_len=128, max_num_seqs=2, max_waiting_requests=1,
              record_trace=True)
    prompts = [{"prompt_token_ids": p} for p in [*GOOD_PROMPTS, last_prompt]]
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, [GREEDY] * len(GOOD_PROMPTS) + [last], use_tqdm=False)
    assert llm.step_trace.records == []  # nothing ran
    assert not llm.llm_engine.has_unfinished_requests()


def test_priority_is_refused_unless_priority_scheduling(tiny_llama_dir, llm):
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate([[5, 6]], GREEDY, priority=[3], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    ranked = LLM(str(tiny_llama_dir), max_model_len=128, scheduling_policy="priority")
    out = ranked.generate([[5, 6]], GREEDY, priority=[3], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_an_interrupted_call_leaves_nothing_behind(llm, expected, monkeypatch):
    engine = llm.llm_engine
    real_step, calls = engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": p} for p in GOOD_PROMPTS], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()
    outs = llm.generate([{"prompt_token_ids": p} for p in GOOD_PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        (None, GREEDY, "prompts must be .* got NoneType"),
        ([[5, 6]], {"max_tokens": 4}, "sampling_params must be SamplingParams.* got dict"),
        ([[5, 6], [7]], [GREEDY, {"max_tokens": 4}], r"sampling_params\[1\] .* got dict"),
    ],
    ids=["prompts None", "params a dict", "one params a dict"],
)
def test_generate_names_the_wrong_argument_type(llm, expected, prompts, params, message):
    with pytest.raises(TypeError, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    outs = llm.generate([{"prompt_token_ids": p} for p in GOOD_PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_unknown_engine_option_raises(tiny_llama_dir):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(str(tiny_llama_dir), max_num_seq=4)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
        (dict(max_model_len=0), "max_model_len must be >= 2"),
        (dict(seed=1.5), "seed must be an integer"),
        (dict(seed=10**30), "seed must be in"),
        (dict(max_logprobs=1.5), "max_logprobs must be an integer"),
        (dict(record_trace="yes"), "record_trace must be True or False"),
        (dict(device="xyz"), "device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        (dict(tensor_parallel_size=2), "tensor_parallel_size=2 is not supported"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization=1.5 is not supported"),
        (dict(tokenizer="other-dir"), "tokenizer='other-dir' is not supported"),
        (dict(cpu_offload_gb=4), "cpu_offload_gb=4 is not supported"),
    ],
)
def test_bad_engine_options_are_refused_by_name(tiny_llama_dir, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama_dir), **options)


def test_a_vllm_script_s_engine_arguments_run_as_is(tiny_llama_dir, expected):
    """vLLM's usual arguments at values that change nothing here, and its None defaults
    (scripts pass ``args.block_size`` through): None means inflight's default."""
    llm = LLM(
        str(tiny_llama_dir), max_model_len=128, max_num_seqs=4, tensor_parallel_size=1,
        enforce_eager=True, gpu_memory_utilization=0.9, trust_remote_code=True, swap_space=4,
        cpu_offload_gb=0, tokenizer=None, revision=None, disable_log_stats=True,
        kv_cache_memory_bytes=None, seed=None, enable_prefix_caching=None,
        enable_chunked_prefill=None, block_size=None, distributed_executor_backend=None,
        enable_sleep_mode=False,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in GOOD_PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_bytes_are_not_token_ids(llm):
    with pytest.raises(TypeError, match="bytes"):
        llm.generate(b"Hello", GREEDY, use_tqdm=False)


def test_missing_model_raises_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "no-such-model"))


def test_bad_quantization_option_raises(tiny_llama_dir):
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(tiny_llama_dir), quantization="int3")
    # A Hugging Face directory has no GGUF blocks to compute from.
    with pytest.raises(ValueError, match="needs a GGUF file"):
        LLM(str(tiny_llama_dir), quantization="gguf")
