"""`toy-vlm`: a tiny LLaVA trained here on synthetic scenes whose true object regions are known.

It is the ground truth for visual attribution (METHODS.md, method 4, vSTREAM: Kang et al., "Real-Time
Visual Attribution Streaming in Thinking Models", arXiv 2604.16587). The model is a real
`LlavaForConditionalGeneration` (Liu et al., "Visual Instruction Tuning", 2023) with a tiny CLIP
vision tower and a tiny Llama, so everything that works on it works on `hf:` LLaVA models too.

Scenes: 2-4 coloured shapes (filled square, ring, cross: maximally distinct) on a 3x3 grid of a 48x48
image, one object per cell, each cell exactly one 16x16 patch of the vision tower, so cell k is visual
token k. A question (colour, shape, position or counting) follows the image; the model answers with a
short reasoning trace that first describes the occupied cells in reading order and then answers:

    <bos> <image> x9 what colour is the ring ?
    ->  ring : top-left red ring yes , center blue cross no . answer red <eos>

The description phrase naming cell k ("top-left red ring") must draw on region k: `Example.spans`
gives each phrase's character and token span, its cell and the object's true pixel box and mask.
Describing first is what makes the toy learnable on a CPU (DESIGN.md, toy VLM feasibility runs:
without the description the model stays on the "ignore the image" plateau).

Our reconstruction, not a published recipe: the scene grammar, the trace format, the splits (by a
hash of the scene layout, so train, dev and eval scenes are disjoint) and the training schedule.

Example:
    >>> ex = examples("eval", 1, seed=0)[0]
    >>> ex.image.shape, ex.image.dtype
    ((48, 48, 3), dtype('uint8'))
    >>> span = ex.spans[0]
    >>> ex.trace[span.start:span.end] == f"{CELL_NAMES[span.cell]} {ex.objects[0].colour} {ex.objects[0].shape}"
    True
    >>> is_correct(ex.trace, ex)
    True
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from thoughtscope.errors import BadInputError

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Scenes: the generator and its ground truth
# ---------------------------------------------------------------------------------------------

GRID = 3  # cells per side
CELL = 16  # pixels per cell side = the vision tower's patch size, so one cell is one visual token
IMAGE_SIZE = GRID * CELL
CELL_NAMES = ("top-left", "top", "top-right", "left", "center", "right", "bottom-left", "bottom", "bottom-right")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 25),
    "green": (20, 190, 40),
    "blue": (40, 80, 255),
    "yellow": (250, 220, 0),
    "magenta": (220, 0, 220),
}
SHAPES = ("square", "ring", "cross")
QUESTION_TYPES = ("colour", "shape", "position", "count")
SPLITS = ("train", "dev", "eval")
MIN_OBJECTS, MAX_OBJECTS = 2, 4
OBJECT_SIZES = (11, 12, 13, 14)  # side in pixels; the object keeps a 1-pixel margin inside its cell
RING_WIDTH = 3
CROSS_WIDTH = 4
ANSWER_MARK = "answer"
MATCH, NO_MATCH = "yes", "no"  # the trace checks each described object against the question's key
# Scenes are assigned to splits by a hash of their layout (cells, colours, shapes): 80/10/10.
_SPLIT_BUCKETS = {"train": range(0, 16), "dev": range(16, 18), "eval": range(18, 20)}


def shape_mask(shape: str, size: int) -> np.ndarray:
    """The boolean `size` x `size` stencil of a shape."""
    m = np.zeros((size, size), dtype=bool)
    if shape == "square":
        m[:] = True
    elif shape == "ring":
        m[:] = True
        m[RING_WIDTH:size - RING_WIDTH, RING_WIDTH:size - RING_WIDTH] = False
    elif shape == "cross":
        lo = (size - CROSS_WIDTH) // 2
        m[lo:lo + CROSS_WIDTH, :] = True
        m[:, lo:lo + CROSS_WIDTH] = True
    else:
        raise BadInputError(f"unknown shape {shape!r}; choose one of {SHAPES}")
    return m


@dataclass(frozen=True)
class SceneObject:
    """One object: its colour, shape, grid cell (0-8, reading order) and true pixel box.

    `box` is (x0, y0, x1, y1) in pixels with exclusive ends; `mask()` is the exact set of pixels
    painted in the object's colour (inside the box; a ring's hole and a cross's corners are not).
    """

    colour: str
    shape: str
    cell: int
    box: tuple[int, int, int, int]

    @property
    def cell_name(self) -> str:
        return CELL_NAMES[self.cell]

    def mask(self) -> np.ndarray:
        """Boolean IMAGE_SIZE x IMAGE_SIZE mask of the object's pixels: the attribution ground truth."""
        x0, y0, x1, y1 = self.box
        full = np.zeros((IMAGE_SIZE, IMAGE_SIZE), dtype=bool)
        full[y0:y1, x0:x1] = shape_mask(self.shape, x1 - x0)
        return full


@dataclass(frozen=True)
class Span:
    """A description phrase ("top-left red ring") and the cell and object it names.

    `start`/`end`: character offsets in `Example.trace`; `token_start`/`token_end`: word (= token)
    offsets in the trace; `Example.input_positions(span)` gives its positions in the model's input.
    """

    cell: int
    object_index: int
    start: int
    end: int
    token_start: int
    token_end: int


@dataclass(eq=False)
class Example:
    """A scene, a question about it, and the target trace: the question's key word, the description
    with each object checked against the key, then the answer (read off the checked objects)."""

    image: np.ndarray  # uint8, IMAGE_SIZE x IMAGE_SIZE x 3
    objects: tuple[SceneObject, ...]  # in reading order (by cell)
    qtype: str
    question: str
    key: str  # the question's key word, repeated at the start of the trace
    answer: str
    trace: str
    spans: tuple[Span, ...]
    split: str
    index: int

    @property
    def layout(self) -> tuple[tuple[int, str, str], ...]:
        return layout_of(self.objects)

    @property
    def description(self) -> str:
        return description_of(self.trace)

    def input_positions(self, span: Span) -> range:
        """Where the span's tokens sit in `build_inputs(self, tok, with_trace=True)["input_ids"]`
        (the logits predicting them are one position earlier)."""
        start = prompt_length(self.question)
        return range(start + span.token_start, start + span.token_end)

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "image"}
        d["objects"] = [asdict(o) for o in self.objects]
        return d


def layout_of(objects: Sequence[SceneObject]) -> tuple[tuple[int, str, str], ...]:
    """What makes two scenes the same scene: cells, colours and shapes (not jitter, not the question)."""
    return tuple(sorted((o.cell, o.colour, o.shape) for o in objects))


def split_of(objects: Sequence[SceneObject]) -> str:
    """The split a layout belongs to, fixed by a hash, so no scene is in two splits."""
    key = "|".join(f"{c}:{col}:{sh}" for c, col, sh in layout_of(objects))
    bucket = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 20
    return next(name for name, r in _SPLIT_BUCKETS.items() if bucket in r)


def make_objects(rng: np.random.Generator, n_objects: tuple[int, int] = (MIN_OBJECTS, MAX_OBJECTS)):
    """2-4 (`n_objects`) objects in distinct cells with distinct (colour, shape) pairs, in reading order."""
    n = int(rng.integers(n_objects[0], n_objects[1] + 1))
    cells = sorted(rng.choice(GRID * GRID, size=n, replace=False).tolist())
    kinds = [(c, s) for c in COLOURS for s in SHAPES]
    picks = rng.choice(len(kinds), size=n, replace=False)
    objects = []
    for cell, k in zip(cells, picks):
        colour, shape = kinds[int(k)]
        size = int(rng.choice(OBJECT_SIZES))
        dx, dy = (int(v) for v in rng.integers(1, CELL - size, size=2))  # 1..CELL-size-1: 1-pixel margin
        x0, y0 = (cell % GRID) * CELL + dx, (cell // GRID) * CELL + dy
        objects.append(SceneObject(colour, shape, cell, (x0, y0, x0 + size, y0 + size)))
    return tuple(objects)


def render(objects: Sequence[SceneObject]) -> np.ndarray:
    """The scene as a uint8 RGB image on a black background."""
    image = np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    for o in objects:
        image[o.mask()] = COLOURS[o.colour]
    return image


def _unique(objects, attr):
    values = [getattr(o, attr) for o in objects]
    return [o for o in objects if values.count(getattr(o, attr)) == 1]


def ask(objects: Sequence[SceneObject], rng: np.random.Generator) -> tuple[str, str, str, str]:
    """(question type, question, key, answer): a question whose answer can be read off the description
    by looking up one key word (the word after "the" or "many", which the trace repeats).

    colour: "what colour is the ring ?" (a shape that occurs once); shape: "what shape is the red
    one ?" (a colour that occurs once); position: "where is the ring ?" or "where is the red one ?";
    count: "how many red ?", "how many ring ?" or "how many objects ?".
    """
    by_shape, by_colour = _unique(objects, "shape"), _unique(objects, "colour")
    options = {"colour": by_shape, "shape": by_colour, "position": by_shape + by_colour, "count": [None]}
    qtype = str(rng.choice([q for q in QUESTION_TYPES if options[q]]))
    if qtype == "count":
        kind = int(rng.integers(3))
        if kind == 0:
            return qtype, "how many objects ?", "objects", str(len(objects))
        attr, key = ("colour", str(rng.choice(list(COLOURS)))) if kind == 1 else ("shape", str(rng.choice(SHAPES)))
        return qtype, f"how many {key} ?", key, str(sum(getattr(o, attr) == key for o in objects))
    pick = int(rng.integers(len(options[qtype])))
    target = options[qtype][pick]
    if qtype == "colour":
        return qtype, f"what colour is the {target.shape} ?", target.shape, target.colour
    if qtype == "shape":
        return qtype, f"what shape is the {target.colour} one ?", target.colour, target.shape
    if pick < len(by_shape):
        return qtype, f"where is the {target.shape} ?", target.shape, target.cell_name
    return qtype, f"where is the {target.colour} one ?", target.colour, target.cell_name


def matches(obj: SceneObject, key: str) -> bool:
    """Whether an object is one the question's key word asks about (every object for "objects")."""
    return key in (obj.colour, obj.shape, "objects")


def describe(objects: Sequence[SceneObject], key: str) -> tuple[str, tuple[Span, ...]]:
    """The trace up to the answer: the key, then the cell-by-cell description with a yes/no check of
    each object against the key ("ring : top-left red ring yes , center blue cross no ."), and the
    description spans (character and word offsets in that text)."""
    text, spans, n_words = f"{key} : ", [], 2
    for i, o in enumerate(objects):
        phrase = f"{o.cell_name} {o.colour} {o.shape}"
        spans.append(Span(o.cell, i, len(text), len(text) + len(phrase), n_words, n_words + 3))
        flag = MATCH if matches(o, key) else NO_MATCH
        text += f"{phrase} {flag}" + (" , " if i < len(objects) - 1 else " .")
        n_words += 5
    return text, tuple(spans)


def make_example(rng: np.random.Generator, split: str, index: int = 0,
                 n_objects: tuple[int, int] = (MIN_OBJECTS, MAX_OBJECTS)) -> Example:
    """Draw scenes until one falls in `split`, then ask a question about it."""
    if split not in SPLITS:
        raise BadInputError(f"unknown split {split!r}; choose one of {SPLITS}")
    while True:
        objects = make_objects(rng, n_objects)
        if split_of(objects) == split:
            break
    qtype, question, key, answer = ask(objects, rng)
    text, spans = describe(objects, key)
    trace = f"{text} {ANSWER_MARK} {answer}"
    return Example(render(objects), objects, qtype, question, key, answer, trace, spans, split, index)


def _split_rng(split: str, seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, SPLITS.index(split) if split in SPLITS else 99])


def examples(split: str, n: int, seed: int = 0) -> list[Example]:
    """`n` examples of `split`, the same for the same seed."""
    rng = _split_rng(split, seed)
    return [make_example(rng, split, i) for i in range(n)]


def example_stream(split: str, seed: int = 0, n_objects: tuple[int, int] = (MIN_OBJECTS, MAX_OBJECTS)):
    """An endless seeded stream of examples (training draws fresh scenes every step)."""
    if n_objects == (MIN_OBJECTS, MAX_OBJECTS):
        rng = _split_rng(split, seed)
    else:  # another scene size (the shape warm-up) draws from its own seeded stream
        rng = np.random.default_rng([seed, *n_objects])
    i = 0
    while True:
        yield make_example(rng, split, i, n_objects)
        i += 1


def parse_answer(text: str) -> str | None:
    """The word after the last answer marker, or None when the text never answers."""
    words = text.replace("<eos>", " ").split()
    marks = [i for i, w in enumerate(words) if w == ANSWER_MARK]
    if not marks or marks[-1] + 1 >= len(words):
        return None
    return words[marks[-1] + 1]


def is_correct(text: str, example: Example) -> bool:
    """Whether a generated trace ends with the right answer (the description is not checked)."""
    return parse_answer(text) == example.answer


def description_of(text: str) -> str:
    """The description in a trace: the words after the key's ':' up to and including the first '.'."""
    words = text.replace("<eos>", " ").split()
    words = words[words.index(":") + 1:] if ":" in words else words
    return " ".join(words[: words.index(".") + 1]) if "." in words else " ".join(words)


# ---------------------------------------------------------------------------------------------
# The model: tokenizer, image preprocessing, inputs, region -> visual-token mapping
# ---------------------------------------------------------------------------------------------

IMAGE_TOKEN = "<image>"
N_IMAGE_TOKENS = GRID * GRID  # patches of the vision tower; its CLS token is dropped ("default" strategy)
QUESTION_WORDS = "what colour is the ? shape one where how many objects".split()
WORDS = [IMAGE_TOKEN, *CELL_NAMES, *COLOURS, *SHAPES, *(str(n) for n in range(MAX_OBJECTS + 1)),
         *QUESTION_WORDS, ",", ".", ":", MATCH, NO_MATCH, ANSWER_MARK]


def make_tokenizer():
    """The word-level tokenizer: one id per word, `<image>` a special token (so a processor's
    "<image><image>..." splits into image tokens, and decoding with skip_special_tokens drops them)."""
    from probes.toys.common import word_tokenizer

    tok = word_tokenizer(WORDS)
    tok.add_special_tokens({"extra_special_tokens": [IMAGE_TOKEN]})
    return tok


def processor_for(tokenizer):
    """A `transformers.LlavaProcessor` equivalent to `build_inputs`, for code written for `hf:` LLaVA
    models: `processor(images=image, text="<bos> <image> what colour is the ring ?")` expands the one
    `<image>` into the nine image tokens and makes the same pixel values as `pixel_values`."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    image_processor = CLIPImageProcessorPil(
        do_resize=False, do_center_crop=False, do_rescale=True, do_normalize=True, do_convert_rgb=True,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=CELL,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          image_token=IMAGE_TOKEN)


def _as_array(image) -> np.ndarray:
    arr = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image)
    if arr.dtype != np.uint8 or arr.shape != (IMAGE_SIZE, IMAGE_SIZE, 3):
        raise BadInputError(f"toy-vlm takes {IMAGE_SIZE}x{IMAGE_SIZE} RGB uint8 images (PIL or HxWx3 array); "
                            f"got {arr.dtype} {arr.shape}")
    return arr


def pixel_values(images) -> torch.Tensor:
    """[n, 3, 48, 48] float pixel values in [-1, 1] from uint8 HxWx3 arrays or PIL images."""
    x = np.stack([_as_array(im) for im in images]).transpose(0, 3, 1, 2).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(x / np.float32(127.5) - np.float32(1.0)))


def prompt_words(question: str) -> list[str]:
    return ["<bos>", *[IMAGE_TOKEN] * N_IMAGE_TOKENS, *question.split()]


def prompt_text(question: str) -> str:
    """The prompt in the processor's form (one `<image>`, expanded to nine by `processor_for`)."""
    return f"<bos> {IMAGE_TOKEN} {question}"


def prompt_length(question: str) -> int:
    """Tokens before the trace: its first token sits at this index of the input sequence."""
    return len(prompt_words(question))


def _item(item) -> tuple[np.ndarray, str, str | None]:
    if isinstance(item, Example):
        return item.image, item.question, item.trace
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise BadInputError("toy-vlm inputs are Examples or (image, question) pairs")
    image, question = item
    if not isinstance(question, str) or not question.split():
        raise BadInputError("a toy-vlm question must be a non-empty string, e.g. 'what colour is the ring ?'")
    return image, question, None


def _ids(vocab: dict[str, int], words: list[str]) -> list[int]:
    unknown = [w for w in words if w not in vocab]
    if unknown:
        raise BadInputError(f"words outside toy-vlm's vocabulary: {sorted(set(unknown))}; it knows {WORDS}")
    return [vocab[w] for w in words]


def build_inputs(item, tokenizer, with_trace: bool = False) -> dict[str, torch.Tensor]:
    """Model inputs for one example or one (image, question) pair: input_ids, attention_mask,
    pixel_values (batch of one). With `with_trace` the example's trace and `<eos>` follow the prompt."""
    return batch_inputs([item], tokenizer, with_trace=with_trace)


def batch_inputs(items: Sequence, tokenizer, with_trace: bool = False, padding_side: str = "right"):
    """Padded batch inputs; with `with_trace`, also `labels` (-100 on the prompt and padding)."""
    rows, label_rows, images = [], [], []
    vocab = tokenizer.get_vocab()
    for item in items:
        image, question, trace = _item(item)
        prompt = _ids(vocab, prompt_words(question))
        target: list[int] = []
        if with_trace:
            if trace is None:
                raise BadInputError("with_trace needs Example items (an (image, question) pair has no trace)")
            target = _ids(vocab, trace.split()) + [tokenizer.eos_token_id]
        rows.append(prompt + target)
        label_rows.append([-100] * len(prompt) + target)
        images.append(image)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (r, lab) in enumerate(zip(rows, label_rows)):
        sl = slice(width - len(r), width) if padding_side == "left" else slice(0, len(r))
        ids[i, sl], mask[i, sl], labels[i, sl] = torch.tensor(r), 1, torch.tensor(lab)
    out = {"input_ids": ids, "attention_mask": mask, "pixel_values": pixel_values(images)}
    if with_trace:
        out["labels"] = labels
    return out


def image_token_positions(input_ids, image_token_id: int) -> list[int]:
    """Indices of the nine image tokens in one input sequence (patch order: reading order)."""
    ids = torch.as_tensor(input_ids).reshape(-1)
    pos = (ids == image_token_id).nonzero().flatten().tolist()
    if len(pos) != N_IMAGE_TOKENS:
        raise BadInputError(f"a toy-vlm input holds exactly {N_IMAGE_TOKENS} image tokens; this one has {len(pos)}")
    return pos


def cell_token_indices(input_ids, image_token_id: int) -> list[list[int]]:
    """For each grid cell (reading order), its visual-token indices in the input sequence.

    One cell is one 16x16 patch, so each list holds one index; finer regions use `box_token_indices`.
    """
    return [[p] for p in image_token_positions(input_ids, image_token_id)]


def box_token_indices(input_ids, box: tuple[int, int, int, int], image_token_id: int) -> list[int]:
    """Visual-token indices of the patches a pixel box (x0, y0, x1, y1; exclusive ends) overlaps."""
    x0, y0, x1, y1 = (int(v) for v in box)
    if not (0 <= x0 < x1 <= IMAGE_SIZE and 0 <= y0 < y1 <= IMAGE_SIZE):
        raise BadInputError(f"box {box} is not a non-empty region inside the {IMAGE_SIZE}x{IMAGE_SIZE} image")
    pos = image_token_positions(input_ids, image_token_id)
    cols = range(x0 // CELL, (x1 - 1) // CELL + 1)
    rows = range(y0 // CELL, (y1 - 1) // CELL + 1)
    return [pos[r * GRID + c] for r in rows for c in cols]


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToyVLMConfig:
    """Architecture and training schedule of one toy-vlm size."""

    vision_layers: int = 2
    vision_width: int = 128
    vision_heads: int = 4
    text_layers: int = 3
    text_width: int = 192
    text_heads: int = 6
    steps: int = 2000
    batch_size: int = 64
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    answer_weight: float = 1.0  # loss weight of the answer token (the description has ~16 tokens, it one)
    vision_lr_mult: float = 1.0  # learning-rate factor of the vision tower and projector
    # Shape warm-up: the first steps show one object per scene, so attention spread over the image
    # still lands on it and the vision tower gets a clean signal for shape (colour is linear in the
    # pixels and comes for free; shape is what stalls without this).
    single_object_steps: int = 150
    threads: int = 1  # one thread: the same weights on every machine, and no slowdown on a shared machine
    seed: int = 0
    n_eval: int = 600

    def recipe(self) -> dict[str, Any]:
        scenes = dict(grid=GRID, cell=CELL, colours=COLOURS, shapes=SHAPES, sizes=OBJECT_SIZES, words=WORDS,
                      objects=(MIN_OBJECTS, MAX_OBJECTS), ring=RING_WIDTH, cross=CROSS_WIDTH, version=1)
        return {"config": asdict(self), "scenes": scenes}


CONFIGS = {
    "full": ToyVLMConfig(),
    # Trains in about 40 s of one core; answers well above the image-blind floor, not at the target.
    "small": ToyVLMConfig(vision_layers=1, vision_width=64, vision_heads=2, text_layers=2, text_width=128,
                          text_heads=4, steps=450, batch_size=32, lr=3e-3, warmup=30, single_object_steps=60,
                          n_eval=200),
}


def build_model(config: ToyVLMConfig, tokenizer, attn_implementation: str = "eager", grid: int = GRID):
    """A randomly initialised `LlavaForConditionalGeneration` of `config`'s size (seeded).

    `grid` other than GRID gives the same architecture with a (grid*CELL)-pixel input, so grid*grid
    visual tokens: never trained, it serves cost benchmarks at more regions (vis_attr_speedup at K = 16)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=config.vision_width, intermediate_size=2 * config.vision_width,
                              num_hidden_layers=config.vision_layers, num_attention_heads=config.vision_heads,
                              image_size=grid * CELL, patch_size=CELL, hidden_act="gelu")
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=config.text_width,
                       intermediate_size=2 * config.text_width, num_hidden_layers=config.text_layers,
                       num_attention_heads=config.text_heads, num_key_value_heads=config.text_heads,
                       max_position_embeddings=64 + grid * grid - N_IMAGE_TOKENS, tie_word_embeddings=False,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    cfg = LlavaConfig(vision_config=vision, text_config=text,
                      image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                      image_seq_length=grid * grid, vision_feature_layer=-1,
                      vision_feature_select_strategy="default")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = LlavaForConditionalGeneration(cfg)
    model.set_attn_implementation(attn_implementation)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def _lr_at(step: int, config: ToyVLMConfig) -> float:
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    frac = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _weighted_loss(model, batch: dict[str, torch.Tensor], answer_weight: float) -> torch.Tensor:
    """Mean next-token cross-entropy over the trace, the answer token weighted `answer_weight`."""
    labels = batch["labels"][:, 1:]
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    weights = (labels != -100).float()
    # The answer is the last label before <eos>.
    n_targets = weights.sum(1).long()
    first = (labels != -100).float().argmax(1)
    weights[torch.arange(len(labels)), first + n_targets - 2] = answer_weight
    return (nll * weights).sum() / weights.sum()


def train_model(config: ToyVLMConfig, progress: bool = True, on_step=None, on_progress=None):
    """Train a toy-vlm from scratch on fresh training scenes; returns (model, tokenizer, report).
    `on_progress(done, total, message)` is called after every step."""
    from probes.toys.common import training

    tok = make_tokenizer()
    with training(config.threads):  # fixed threads, deterministic algorithms: the same weights each run
        return _train(config, tok, progress, on_step, on_progress)


def _train(config: ToyVLMConfig, tok, progress: bool, on_step, on_progress=None):
    from tqdm.auto import tqdm

    # Eager attention: on this CPU it trained faster than sdpa, and attention weights need it anyway.
    model = build_model(config, tok, attn_implementation="eager")
    model.train()
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in model.named_parameters():
        vision = name.startswith(("model.vision_tower", "model.multi_modal_projector"))
        decay = p.ndim >= 2 and "embed" not in name
        groups.setdefault((vision, decay), []).append(p)
    opt = torch.optim.AdamW(
        [{"params": ps, "weight_decay": config.weight_decay if decay else 0.0,
          "lr_mult": config.vision_lr_mult if vision else 1.0} for (vision, decay), ps in sorted(groups.items())],
        lr=config.lr, betas=(0.9, 0.98))
    stream = example_stream("train", config.seed)
    warmup_stream = example_stream("train", config.seed, n_objects=(1, 1))
    losses: list[float] = []
    start, cpu_start = time.perf_counter(), time.process_time()
    bar = tqdm(range(config.steps), desc="training toy-vlm", disable=not progress, mininterval=1.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        for step in bar:
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, config) * group["lr_mult"]
            source = warmup_stream if step < config.single_object_steps else stream
            batch = batch_inputs([next(source) for _ in range(config.batch_size)], tok, with_trace=True)
            loss = _weighted_loss(model, batch, config.answer_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if step % 20 == 0:
                bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
            if on_step is not None:
                on_step(step, model, tok, losses[-1])
            if on_progress is not None:
                on_progress(step + 1, config.steps, "training toy-vlm")
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    model.eval()
    report = {
        "config": asdict(config),
        "steps": config.steps,
        # On a shared machine wall time overstates the cost; with one thread, CPU time is what a
        # quiet machine would take.
        "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu_seconds, 1),
        "images_per_s": round(config.steps * config.batch_size / seconds, 1),
        "images_per_cpu_s": round(config.steps * config.batch_size / cpu_seconds, 1),
        "threads": config.threads,
        "final_loss": round(float(np.mean(losses[-50:])), 4),
    }
    return model, tok, report


# ---------------------------------------------------------------------------------------------
# Generation and evaluation
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def generate_traces(model, tokenizer, items: Sequence, max_new_tokens: int = 24, batch_size: int = 128) -> list[str]:
    """Greedy traces for examples or (image, question) pairs, batched by prompt length (no padding)."""
    by_length: dict[int, list[int]] = {}
    for i, item in enumerate(items):
        by_length.setdefault(prompt_length(_item(item)[1]), []).append(i)
    out: list[str] = [""] * len(items)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    for length, idx in sorted(by_length.items()):
        for lo in range(0, len(idx), batch_size):
            chunk = idx[lo:lo + batch_size]
            inputs = batch_inputs([items[i] for i in chunk], tokenizer)
            new = model.generate(
                input_ids=inputs["input_ids"].to(device), attention_mask=inputs["attention_mask"].to(device),
                pixel_values=inputs["pixel_values"].to(device, dtype), max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            )[:, length:]
            for i, row in zip(chunk, new):
                out[i] = tokenizer.decode(row, skip_special_tokens=True).strip()
    return out


def evaluate(model, tokenizer, items: Sequence[Example], progress: bool = False) -> dict[str, Any]:
    """Held-out scores of greedy traces: answer accuracy, exact match of the whole trace and of the
    description, the share of objects described correctly; overall and per question type."""
    traces = generate_traces(model, tokenizer, items)

    def scores(pairs):
        n = len(pairs)
        objects = [(f"{o.cell_name} {o.colour} {o.shape}", t) for ex, t in pairs for o in ex.objects]
        return {
            "n": n,
            "answer_accuracy": sum(is_correct(t, ex) for ex, t in pairs) / max(1, n),
            "trace_exact_match": sum(t == ex.trace for ex, t in pairs) / max(1, n),
            "description_exact_match": sum(description_of(t) == ex.description for ex, t in pairs) / max(1, n),
            "objects_described": sum(_phrase_in(p, t) for p, t in objects) / max(1, len(objects)),
        }

    pairs = list(zip(items, traces))
    report = scores(pairs)
    report["per_type"] = {q: scores([(ex, t) for ex, t in pairs if ex.qtype == q]) for q in QUESTION_TYPES}
    return report


def _phrase_in(phrase: str, trace: str) -> bool:
    words, target = description_of(trace).split(), phrase.split()
    return any(words[i:i + 3] == target for i in range(len(words) - 2))


def blind_accuracy(n: int = 3000, seed: int = 0) -> float:
    """Accuracy of the best image-blind answerer (the most frequent training answer per question), on
    fresh eval examples: the floor a model must beat to show it reads the image."""
    from collections import Counter

    counts: dict[str, Counter] = {}
    for ex in examples("train", n, seed=seed):
        counts.setdefault(ex.question, Counter())[ex.answer] += 1
    held_out = examples("eval", n // 10, seed=seed + 1)
    return sum(counts.get(ex.question, Counter({"": 1})).most_common(1)[0][0] == ex.answer
               for ex in held_out) / len(held_out)


# ---------------------------------------------------------------------------------------------
# Ground-truth check: masking attention to an object's visual tokens
# ---------------------------------------------------------------------------------------------


def blocking_mask(length: int, blocked: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A [1, 1, length, length] additive causal mask in which no query outside `blocked` sees the
    keys in `blocked` (in every layer it is passed to): vSTREAM's "attention to V_k masked"."""
    neg = torch.finfo(dtype).min
    mask = torch.full((length, length), neg, dtype=dtype).triu(1)
    b = torch.as_tensor(list(blocked), dtype=torch.long)
    if len(b):
        outside = torch.ones(length, dtype=torch.bool)
        outside[b] = False
        rows = outside.nonzero().flatten()
        mask[rows[:, None], b[None, :]] = neg
    return mask[None, None]


@torch.no_grad()
def trace_logprobs(model, tokenizer, example: Example, blocked: Sequence[Sequence[int]] = ((),),
                   images: Sequence[np.ndarray] | None = None) -> torch.Tensor:
    """Teacher-forced log-probabilities of the example's trace tokens, one row per variant:
    `blocked[i]` are the input positions hidden from the rest of the sequence in variant i, and
    `images[i]` (optional) replaces the example's image. Shape [variants, trace words + 1 (<eos>)]."""
    inputs = build_inputs(example, tokenizer, with_trace=True)
    ids, labels = inputs["input_ids"], inputs["labels"]
    n = max(len(blocked), len(images) if images is not None else 0)
    blocked = list(blocked) * n if len(blocked) == 1 else list(blocked)
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    pv = pixel_values(images) if images is not None else inputs["pixel_values"].expand(n, -1, -1, -1)
    mask = torch.cat([blocking_mask(ids.shape[1], b, dtype) for b in blocked])
    logits = model(input_ids=ids.expand(n, -1).to(device), pixel_values=pv.to(device, dtype),
                   attention_mask=mask.to(device)).logits.float()
    logp = logits[:, :-1].log_softmax(-1)
    targets = labels[0, 1:]
    keep = (targets != -100).nonzero().flatten()
    return logp[:, keep, :].gather(-1, targets[keep].to(device)[None, :, None].expand(n, -1, 1))[..., 0].cpu()


def region_masking_effects(model, tokenizer, items: Sequence[Example], seed: int = 0) -> dict[str, Any]:
    """For each description span on held-out scenes: the drop (nats) in the span's log-probability when
    attention to its own object's visual tokens is masked in all layers, against masking a random
    other cell or another object's cell; and the same with the object's pixels painted background."""
    rng = np.random.default_rng(seed)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    rows: list[dict[str, float]] = []
    for ex in items:
        cells = cell_token_indices(build_inputs(ex, tokenizer)["input_ids"], image_id)
        for span in ex.spans:
            other_cell = int(rng.choice([c for c in range(GRID * GRID) if c != span.cell]))
            other = ex.objects[int(rng.choice([i for i in range(len(ex.objects)) if i != span.object_index]))]
            lp = trace_logprobs(model, tokenizer, ex, [(), cells[span.cell], cells[other_cell], cells[other.cell]])
            blank = [ex.image.copy() for _ in range(3)]
            blank[1][ex.objects[span.object_index].mask()] = 0
            blank[2][other.mask()] = 0
            lp_blank = trace_logprobs(model, tokenizer, ex, images=blank)
            lp, lp_blank = (x[:, span.token_start:span.token_end].sum(1) for x in (lp, lp_blank))
            rows.append({
                "mask_true": float(lp[0] - lp[1]), "mask_other_cell": float(lp[0] - lp[2]),
                "mask_other_object": float(lp[0] - lp[3]),
                "blank_true": float(lp_blank[0] - lp_blank[1]),
                "blank_other_object": float(lp_blank[0] - lp_blank[2]),
            })
    keys = rows[0].keys() if rows else []
    out: dict[str, Any] = {"n_spans": len(rows), "n_examples": len(items)}
    out["mean_drop_nats"] = {k: round(float(np.mean([r[k] for r in rows])), 3) for k in keys}
    out["true_beats_other_cell"] = round(float(np.mean([r["mask_true"] > r["mask_other_cell"] for r in rows])), 3)
    out["true_beats_other_object"] = round(float(np.mean([r["mask_true"] > r["mask_other_object"] for r in rows])), 3)
    return out


# ---------------------------------------------------------------------------------------------
# The zoo entry: train once, cache, load
# ---------------------------------------------------------------------------------------------


def _train_and_save(config: ToyVLMConfig, folder: Path, progress: bool = True, on_progress=None) -> dict[str, Any]:
    model, tok, report = train_model(config, progress=progress, on_progress=on_progress)
    if on_progress is not None:
        on_progress(config.steps, config.steps, "evaluating toy-vlm on held-out scenes")
    held_out = examples("eval", config.n_eval, seed=config.seed)
    report["eval"] = evaluate(model, tok, held_out)
    report["blind_accuracy"] = blind_accuracy(seed=config.seed)
    report["region_masking"] = region_masking_effects(model, tok, held_out[: config.n_eval // 6], seed=config.seed)
    model.save_pretrained(folder)  # safetensors
    processor_for(tok).save_pretrained(folder)  # tokenizer + image processor: the folder loads as hf:<folder>
    log.info("toy-vlm %s: held-out answer accuracy %.3f", "trained", report["eval"]["answer_accuracy"])
    return report


def _check_size(size: str) -> None:
    from thoughtscope.errors import UnknownModelError

    if size not in CONFIGS:
        raise UnknownModelError(f"toy-vlm has sizes {', '.join(CONFIGS)} (toy-vlm or toy-vlm:small), not {size!r}")


def recipe(size: str = "full") -> dict[str, Any]:
    """Everything that decides the weights of a size: the cache folder is named by its hash."""
    _check_size(size)
    return CONFIGS[size].recipe()


def model_folder(size: str = "full") -> Path:
    """Where the weights of a size are read from: the shipped copy (`docs/shipped/models`) when it
    verifies against this recipe, else the user-cache folder (trained or not)."""
    from probes.toys.common import read_folder

    return read_folder("toy-vlm", size, recipe(size))


def train_into(size: str, folder: Path, on_progress=None, progress: bool = True) -> dict[str, Any]:
    """Train a size from scratch into `folder` and return its training report (the zoo's and
    `thoughtscope models ship`'s one way to train it)."""
    _check_size(size)
    return _train_and_save(CONFIGS[size], folder, progress, on_progress)


def load(size: str = "full", dtype: torch.dtype = torch.float32, progress: bool = True, on_progress=None):
    """(model, tokenizer) of a toy-vlm size: the shipped copy, else trained on first use (full: 716 CPU s
    on one thread, about 12 minutes of a quiet core; small: under a minute) and cached as safetensors.
    The model uses eager attention (attention weights)."""
    from transformers import LlavaForConditionalGeneration

    from probes.toys.common import ready_folder

    folder = ready_folder("toy-vlm", size, recipe(size),
                          lambda tmp: train_into(size, tmp, on_progress=on_progress, progress=progress))
    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    model.eval()
    return model, make_tokenizer()


def training_report_of(size: str = "full") -> dict[str, Any]:
    """What the training run of a size wrote about itself (seconds, images/s, held-out scores)."""
    from probes.toys.common import training_report

    return training_report(model_folder(size))
