"""SmolLM2's tokenizer (the embedded model's and every tiny-random model's) is parsed once per process;
each load gets its own deep copy, equal to a fresh parse and independent of every other copy."""

from __future__ import annotations

from transformers import AutoTokenizer

from probes import zoo

TEXTS = ["hello world", "Sara has 9 pencils. 2 + 2 = ?", "<|im_start|>user\nhi<|im_end|>", "ünïcödé 日本語 🙂"]


def test_every_copy_equals_a_fresh_parse_and_is_its_own():
    fresh = AutoTokenizer.from_pretrained(zoo.smollm2_files())
    a, b = zoo.smollm2_tokenizer(), zoo.smollm2_tokenizer()
    assert a is not b and a.backend_tokenizer is not b.backend_tokenizer
    for tok in (a, b):
        assert [tok(t)["input_ids"] for t in TEXTS] == [fresh(t)["input_ids"] for t in TEXTS]
        assert tok.backend_tokenizer.to_str() == fresh.backend_tokenizer.to_str()
        chat = [{"role": "user", "content": "2 + 2 = ?"}]
        assert tok.apply_chat_template(chat, add_generation_prompt=True) == \
            fresh.apply_chat_template(chat, add_generation_prompt=True)
        assert (len(tok), tok.all_special_ids, tok.pad_token) == (len(fresh), fresh.all_special_ids, fresh.pad_token)
    a.pad_token, a.padding_side = "<|endoftext|>", "left"  # what one engine does to its copy stays there
    c = zoo.smollm2_tokenizer()
    assert (c.pad_token, c.padding_side) == (fresh.pad_token, fresh.padding_side) != (a.pad_token, a.padding_side)


def test_the_file_is_parsed_once_per_process_and_folder(llama):
    before = zoo._parsed_tokenizer.cache_info()
    again = zoo.load_model("tiny-random:qwen2")
    after = zoo._parsed_tokenizer.cache_info()
    assert (after.misses, after.hits) == (before.misses, before.hits + 1)
    assert again.tokenizer is not llama.handle.tokenizer
    assert again.tokenizer.encode("2 + 2 =") == llama.encode("2 + 2 =", add_special_tokens=True)
