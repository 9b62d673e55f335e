"""toy-moe: the arithmetic task (splits, verifier, prompt format, chat template) and the trained
fine-grained Qwen3-MoE, loaded through the zoo like any model.

The task tests run in milliseconds. The `model` tests train `toy-moe:small` on first use (under a
minute on 2 quiet cores, cached afterwards) and check the full `toy-moe` reaches its accuracy band
(trained once, several minutes on 2 cores; cached afterwards).
"""

from __future__ import annotations

import random

import pytest
import torch

from probes import Engine
from probes.routing import ExpertSample, TopK
from probes.toys import moe
from thoughtscope.errors import BadInputError


def test_a_problem_its_trace_and_the_verifier():
    p = moe.Problem(12, (("+", 7), ("-", 5), ("+", 9)))
    assert p.values == [19, 14, 23] and p.answer == 23
    assert p.question == "12 + 7 - 5 + 9 = ?"
    assert p.prompt == "Q : 12 + 7 - 5 + 9 = ? A :"
    assert p.trace == " 12 + 7 = 19 , 19 - 5 = 14 , 14 + 9 = 23 . answer 23"
    assert moe.is_correct(p.trace, p) and moe.is_correct(p.trace + " <eos>", p)
    assert not moe.is_correct(" 12 + 7 = 19 , 19 - 5 = 14 , 14 + 9 = 24 . answer 24", p)
    assert not moe.is_correct(" 12 + 7 = 19 , 19 - 5 = 14", p)  # no answer: wrong
    assert moe.parse_answer(" answer 3 . answer 4") == 3  # the first answer counts


def test_splits_are_disjoint_reproducible_and_in_range():
    config = moe.TaskConfig()
    dev, eval_ = moe.problems("dev", 300), moe.problems("eval", 300)
    train = moe.problems("train", 3000)
    assert moe.problems("eval", 50) == eval_[:50]  # a prefix of a longer draw
    assert moe.problems("eval", 50, seed=1) != eval_[:50]
    questions = {name: {p.question for p in ps} for name, ps in (("train", train), ("dev", dev), ("eval", eval_))}
    assert len(questions["dev"]) == 300 and len(questions["eval"]) == 300  # held-out: no repeats
    assert not questions["train"] & questions["dev"] and not questions["train"] & questions["eval"]
    assert not questions["dev"] & questions["eval"]
    for p in train[:500] + dev + eval_:
        assert 2 <= len(p.ops) <= 3 and all(1 <= b <= config.max_operand for _, b in p.ops)
        assert all(0 <= v <= config.max_value for v in p.values)
    assert {len(p.ops) for p in dev} == {2, 3}
    with pytest.raises(BadInputError, match="unknown split"):
        moe.problems("test", 3)
    with pytest.raises(BadInputError, match="non-negative"):
        moe.problems("dev", -1)


def test_tokenizer_words_and_chat_template_render_the_prompt_format():
    tok = moe.build_tokenizer(moe.TaskConfig())
    p = moe.problems("eval", 1)[0]
    ids = tok(p.prompt + p.trace)["input_ids"]
    assert tok.unk_token_id not in ids
    assert len(ids) == len((p.prompt + p.trace).split())  # one token per word: numbers are single tokens
    chat = tok.apply_chat_template([{"role": "user", "content": p.question}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == p.prompt
    assert tok.decode(tok(p.trace)["input_ids"]) == p.trace.strip()


def test_training_sequence_masks_the_prompt():
    tc = moe.TaskConfig()
    tok = moe.build_tokenizer(tc)
    p = moe.problems("train", 1)[0]
    ids, n_prompt = moe.training_sequence(p, tok.get_vocab(), tok.eos_token_id)
    input_ids, mask, labels = moe._batch([(ids, n_prompt)], tok.pad_token_id)
    assert (labels[0, :n_prompt] == -100).all() and labels[0, -1] == tok.eos_token_id
    assert tok.decode(labels[0, n_prompt:-1].tolist()) == p.trace.strip()


def test_unknown_size_is_a_clear_error():
    from thoughtscope.errors import UnknownModelError

    with pytest.raises(UnknownModelError, match="sizes full, small"):
        moe.folder_for("huge")
    with pytest.raises(UnknownModelError, match="toy-moe:small"):
        Engine.from_id("toy-moe:tiny")


@pytest.mark.model
def test_small_toy_moe_trains_and_loads_through_the_zoo():
    engine = Engine.from_id("toy-moe:small")
    arch = engine.handle.arch
    assert type(engine.model).__name__ == "Qwen3MoeForCausalLM"
    assert (arch.n_experts, arch.experts_top_k, arch.n_layers) == (32, 4, 2)
    report = moe.report("small")
    assert report["steps"] == moe.SIZES["small"][0].steps and report["seconds"] > 0
    # the report's held-out accuracy is what the cached weights give on those dev problems, inside the band
    dev = moe.problems("dev", report["heldout_n"], config=moe.task_config("small"))
    assert report["heldout_n"] == 100
    assert report["greedy_accuracy"] == round(moe.greedy_accuracy(engine.model, engine.tok, dev), 4)
    assert 0.5 <= report["greedy_accuracy"] <= 0.95, report
    # chat prompts render to the prompt format; a greedy generation is a verifiable trace
    p = moe.problems("eval", 1, config=moe.task_config("small"))[0]
    assert engine.encode(p.question, chat=True) == engine.encode(p.prompt)
    recs = list(engine.generate(p.question, chat=True, max_new_tokens=30, capture=["router.1"]))
    text = "".join(r.text for r in recs)
    assert recs[-1].token_id in engine.eos_ids() and moe.parse_answer(text) is not None
    assert recs[0].activations["router.1"].shape == (32,)
    # the engine's greedy decoding and the training script's agree
    assert text.replace(" <eos>", "") == moe.greedy_continuations(engine.model, engine.tok, [p.prompt])[0]
    # router rules run on it, and Expert-Sample gives N different samples
    out = list(engine.generate(p.prompt, n_samples=4, max_new_tokens=30,
                               interventions=[ExpertSample(k_h=1, m=8, t_e=1.0, seed=0)]))
    assert len({tuple(r.logprob for r in out if r.batch_index == b) for b in range(4)}) == 4
    assert list(engine.generate(p.prompt, max_new_tokens=30, interventions=[TopK()]))[-1].text == recs[-1].text


@pytest.mark.model
@pytest.mark.slow
def test_full_toy_moe_reaches_its_accuracy_band():
    """The organism: greedy accuracy on 200 held-out (eval split) problems in the band 0.55-0.9,
    so sampling has errors to fix. Trains once (several minutes on 2 quiet cores), then cached."""
    engine = Engine.from_id("toy-moe")
    report = moe.report("full")
    assert 0.55 <= report["greedy_accuracy"] <= 0.9, report
    held_out = moe.problems("eval", 200)
    correct = 0
    for lo in range(0, len(held_out), 50):
        batch = held_out[lo:lo + 50]
        records = list(engine.generate(prompts=[p.prompt for p in batch], max_new_tokens=32))
        texts = ["".join(r.text for r in records if r.batch_index == b) for b in range(len(batch))]
        correct += sum(moe.is_correct(t, p) for t, p in zip(texts, batch))
    accuracy = correct / len(held_out)
    assert 0.55 <= accuracy <= 0.9, accuracy
    # fewer active experts cost accuracy on this organism (what `eval active-experts` measures)
    sample = random.Random(0).sample(held_out, 50)
    records = list(engine.generate(prompts=[p.prompt for p in sample], max_new_tokens=32,
                                   interventions=[TopK(k=2)]))
    texts = ["".join(r.text for r in records if r.batch_index == b) for b in range(len(sample))]
    assert sum(moe.is_correct(t, p) for t, p in zip(texts, sample)) / len(sample) < accuracy
    assert torch.is_tensor(engine.trace(held_out[0].prompt, capture=["router.2"]).activations["router.2"])
