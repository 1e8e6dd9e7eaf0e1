"""Sluice's OpenAI-compatible endpoint through OpenAI's own Python client, against a real model.

Run by tests/openai/run.sh, which starts the server with SmolLM2-135M-Instruct imported as
`local:smollm2` and passes, in the environment:
  SLUICE_OPENAI_BASE    http://127.0.0.1:PORT/v1
  SLUICE_API_KEY        an API token of the server's admin
  SLUICE_MODEL          the model id (local:smollm2)
  SLUICE_TOKENIZER_DIR  the imported model folder, whose tokenizer transformers reads here

Every check raises on failure; the script exits 1 if any failed, naming each.
"""

import math
import os
import sys
import traceback

import openai
from transformers import AutoTokenizer

BASE = os.environ["SLUICE_OPENAI_BASE"]
KEY = os.environ["SLUICE_API_KEY"]
MODEL = os.environ["SLUICE_MODEL"]
TOKENIZER_DIR = os.environ["SLUICE_TOKENIZER_DIR"]

# No retries: a 503 must show, not be waited out.
client = openai.OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=300)
tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)


class Failed(Exception):
    pass


def expect(condition, message):
    if not condition:
        raise Failed(message)


def models_are_listed():
    ids = [m.id for m in client.models.list()]
    expect(MODEL in ids, f"{MODEL} not in /v1/models: {ids}")
    expect(not any(i.startswith("preset:") for i in ids), f"presets listed: {ids}")
    expect(client.models.retrieve(MODEL).id == MODEL, "models.retrieve gives another id")


def a_completion_continues_greedily():
    reply = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    choice = reply.choices[0]
    expect("Paris" in choice.text, f"greedy SmolLM2 says {choice.text!r}")
    expect(choice.finish_reason in ("stop", "length"), choice.finish_reason)
    usage = reply.usage
    prompt_tokens = len(tokenizer("The capital of France is").input_ids)
    expect(usage.prompt_tokens == prompt_tokens, f"{usage} vs {prompt_tokens} prompt tokens")
    expect(usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, str(usage))
    again = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    expect(again.choices[0].text == choice.text, "greedy decoding is not deterministic")


def echo_gives_each_prompt_tokens_log_probability():
    prompts = ["The capital of France is Paris", "The capital of France is Berlin"]
    reply = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=3
    )
    expect([c.index for c in reply.choices] == [0, 1], "one choice per prompt, in order")
    totals = []
    for prompt, choice in zip(prompts, reply.choices):
        lp = choice.logprobs
        expected_tokens = len(tokenizer(prompt).input_ids)
        expect(choice.text == prompt, f"echo gives {choice.text!r}")
        expect(len(lp.tokens) == expected_tokens, f"{lp.tokens} vs {expected_tokens} tokens")
        expect("".join(lp.tokens) == prompt, f"tokens {lp.tokens} do not join to the prompt")
        expect(lp.token_logprobs[0] is None, "the first token's log-probability is not null")
        expect(lp.top_logprobs[0] is None, "the first token has alternatives")
        expect(lp.text_offset[0] == 0, f"text offsets {lp.text_offset}")
        expect(lp.text_offset == sorted(set(lp.text_offset)), f"offsets {lp.text_offset}")
        for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
            expect(logprob is not None and logprob <= 0, f"{token!r}: {logprob}")
            expect(1 <= len(top) <= 3, f"{token!r}: {top}")
            expect(max(top.values()) >= logprob - 1e-6, f"{token!r} beats its top: {top}")
            expect(sum(math.exp(v) for v in top.values()) <= 1 + 1e-5, f"{token!r}: {top}")
        totals.append(sum(lp.token_logprobs[1:]))
    # Everything before the last word is the same text, so the same scores.
    first, second = reply.choices[0].logprobs, reply.choices[1].logprobs
    expect(first.token_logprobs[:-1] == second.token_logprobs[:-1], "the shared prefix scores differ")
    expect(totals[0] > totals[1] + 2, f"Paris should be far likelier than Berlin: {totals}")


def lm_eval_style_requests_score_token_ids():
    # What lm-eval's local-completions sends for a loglikelihood: token ids, echo, one token.
    context = tokenizer("Question: What is the capital of Italy?\nAnswer:").input_ids
    continuation = tokenizer(" Rome").input_ids
    ids = context + continuation
    reply = client.completions.create(
        model=MODEL, prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0, seed=1234
    )
    lp = reply.choices[0].logprobs
    expect(len(lp.token_logprobs) == len(ids) + 1, f"{len(lp.token_logprobs)} scores for {len(ids)}+1")
    scored = lp.token_logprobs[len(context) : -1]
    expect(len(scored) == len(continuation), f"{scored}")
    text = client.completions.create(
        model=MODEL, prompt=tokenizer.decode(ids), max_tokens=0, echo=True, logprobs=1
    ).choices[0].logprobs
    expect(
        all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(scored, text.token_logprobs[len(context) :])),
        "the same text scored as ids and as text differs",
    )
    new_token, new_top = lp.token_logprobs[-1], lp.top_logprobs[-1]
    expect(math.isclose(new_token, max(new_top.values())), "the greedy token is not the top one")


def chat_answers_through_the_template():
    messages = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30, temperature=0
    )
    choice = reply.choices[0]
    expect(choice.message.role == "assistant", choice.message.role)
    expect("Paris" in choice.message.content, f"SmolLM2 says {choice.message.content!r}")
    expect(choice.finish_reason == "stop", choice.finish_reason)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(rendered, dict) or hasattr(rendered, "input_ids"):
        rendered = rendered["input_ids"]
    expect(reply.usage.prompt_tokens == len(rendered), f"{reply.usage} vs {len(rendered)} template tokens")

    # Streaming: the same answer in pieces, a role first, the finish last, usage when asked.
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, roles, finishes, usage = [], [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                finishes.append(c.finish_reason)
    expect(roles == ["assistant"], f"roles {roles}")
    expect(len(pieces) > 1, f"one piece: {pieces}")
    expect("".join(pieces) == choice.message.content, f"{pieces} vs {choice.message.content!r}")
    expect(finishes == ["stop"], f"finishes {finishes}")
    expect(usage is not None and usage.completion_tokens == reply.usage.completion_tokens, f"{usage}")

    # A stop sequence ends the answer before it.
    cut = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30, temperature=0, stop=[" Paris"]
    ).choices[0]
    expected = choice.message.content.split(" Paris")[0]
    expect(cut.message.content == expected, f"{cut.message.content!r} vs {expected!r}")
    expect(cut.finish_reason == "stop", cut.finish_reason)

    # max_tokens ends it with "length".
    short = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, temperature=0
    )
    expect(short.choices[0].finish_reason == "length", short.choices[0].finish_reason)
    expect(short.usage.completion_tokens == 2, f"{short.usage}")

    # A seed makes sampling repeatable.
    sampled = [
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0.9, top_p=0.95, seed=42
        ).choices[0].message.content
        for _ in range(2)
    ]
    expect(sampled[0] == sampled[1], f"the same seed gave {sampled}")

    # Chat log-probabilities: the greedy token is the top alternative.
    with_logprobs = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    ).choices[0].logprobs.content
    expect(len(with_logprobs) >= 1, "no log-probabilities")
    for entry in with_logprobs:
        expect(len(entry.top_logprobs) == 2, f"{entry}")
        expect(entry.top_logprobs[0].logprob == entry.logprob, f"{entry}")


def errors_are_openai_errors():
    try:
        client.completions.create(model="job-999999/final", prompt="Hi")
        raise Failed("an unknown model was served")
    except openai.NotFoundError as e:
        expect(e.code == "model_not_found" and e.param == "model", f"{e.body}")
    for kwargs, param in [
        ({"n": 2}, "n"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"temperature": 5}, "temperature"),
    ]:
        try:
            client.completions.create(model=MODEL, prompt="Hi", **kwargs)
            raise Failed(f"{kwargs} was accepted")
        except openai.BadRequestError as e:
            expect(e.param == param, f"{kwargs}: param {e.param}, {e.message}")
    try:
        client.completions.create(model=MODEL, prompt="word " * 9000, max_tokens=1)
        raise Failed("a prompt longer than the context was accepted")
    except openai.BadRequestError as e:
        expect(e.param == "prompt", f"param {e.param}: {e.message}")
    stranger = openai.OpenAI(base_url=BASE, api_key="sluice_" + "0" * 64, max_retries=0)
    try:
        stranger.models.list()
        raise Failed("a wrong key was accepted")
    except openai.AuthenticationError:
        pass


CHECKS = [
    models_are_listed,
    a_completion_continues_greedily,
    echo_gives_each_prompt_tokens_log_probability,
    lm_eval_style_requests_score_token_ids,
    chat_answers_through_the_template,
    errors_are_openai_errors,
]


def main():
    failed = []
    for check in CHECKS:
        try:
            check()
            print(f"ok    {check.__name__}")
        except Exception:  # noqa: BLE001 - every failure is reported, then the exit code says so
            failed.append(check.__name__)
            print(f"FAIL  {check.__name__}")
            traceback.print_exc()
    if failed:
        print(f"{len(failed)} of {len(CHECKS)} client checks failed: {', '.join(failed)}")
        sys.exit(1)
    print(f"all {len(CHECKS)} client checks passed")


if __name__ == "__main__":
    main()
