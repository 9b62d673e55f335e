"""Toy models this project trains (DESIGN.md, "Models"): small instances of real transformers classes,
trained by a seeded script on synthetic data whose ground truth is known, on first use, with a progress
bar, cached as safetensors under the user cache directory and never committed.

Each toy is one module with `load(size: str, dtype) -> (model, tokenizer)`; `probes.zoo.TOY_MODELS`
lists them. `common` holds what they share: the cache folder, train-once-under-a-lock, word-level
tokenizers.
"""
