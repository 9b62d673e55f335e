"""Toy models this project trains (DESIGN.md, "Models"): small instances of real transformers classes,
trained by a seeded script on synthetic data whose ground truth is known. The toys the pages use ship
with the repository (`docs/shipped/models/`, verified by sha256 against the recipe: `shipped`, rebuilt
by `thoughtscope models ship ID`); any other is trained on first use, with a progress bar (and an
`on_progress` callback), and cached as safetensors under the user cache directory.

Each toy is one module with `load(size, dtype, on_progress=None) -> (model, tokenizer)`, `recipe(size)`
and `train_into(size, folder, on_progress=None) -> report`; `probes.zoo.TOY_MODELS` lists them.
`common` holds what they share: the cache folder, train-once-under-a-lock, deterministic training,
word-level tokenizers.
"""
