"""Image samples for the fuzzy concepts: toy-vlm scenes, read where the model is about to answer.

The text path reads hidden states at a target word in text; for a vision-language model the issue
asks for "the answer token for toy-vlm scenes". Each sample here is one toy-vlm scene (image plus
question) teacher-forced with its true trace; the row is the hidden state at the trace's `answer`
mark, the position whose next-token prediction is the answer. Only colour and shape questions are
drawn, about one object each, so every row carries that object's known attributes as labels
(`colour`, `shape`) plus the question type: the AMI of the concepts against the scene's ground truth.

Images travel through the Backend (`capture(..., images=[...])`), so this works in-process and
through `thoughtscope serve` alike. One forward per scene: toy scenes are 20-odd tokens.

Example:
    >>> source = SceneSource(n=4)
    >>> source.settings()["kind"], source.word
    ('toy-vlm-scenes', 'answer')
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from analyses.fuzzy_concepts.harvest import Sample
from probes.backend import Backend
from probes.toys import vlm
from thoughtscope.errors import BadInputError

Progress = Callable[[str, int, int], None]
QUESTIONS = ("colour", "shape")  # questions about one object, whose colour and shape are then known
SPLIT = "eval"  # held-out scenes of the toy (disjoint from its training scenes by layout hash)


@dataclass
class SceneSource:
    """`n` toy-vlm scenes with colour or shape questions (seeded), read at the `answer` mark."""

    n: int = 200
    seed: int = 0
    kind: str = "toy-vlm-scenes"
    word: str = "answer"
    _images: dict[str, Any] = field(default_factory=dict, repr=False)

    def settings(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("_images")
        out["split"], out["questions"] = SPLIT, list(QUESTIONS)
        return out

    def validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise BadInputError(f"the number of scenes must be a positive integer, got {self.n!r}")

    def samples(self, backend: Backend, store: Any = None, on_progress: Progress | None = None) -> list[Sample]:
        self.validate()
        if not backend.capabilities().get("vision"):
            raise BadInputError(f"{backend.info()['model_id']} takes no images: scene concepts need a "
                                "vision-language model (toy-vlm)")
        found: list[Sample] = []
        for ex in vlm.example_stream(SPLIT, self.seed):
            if ex.qtype not in QUESTIONS:
                continue
            asked = next(o for o in ex.objects if vlm.matches(o, ex.key))  # the key occurs once (vlm.ask)
            prompt = vlm.prompt_text(ex.question)
            text = f"{prompt} {ex.trace}"
            words = ex.trace.split()
            mark = words.index(vlm.ANSWER_MARK)
            at = text.index(f" {vlm.ANSWER_MARK} ", len(prompt)) + 1
            sample_id = f"scene-{SPLIT}-{self.seed}-{ex.index}"
            self._images[sample_id] = ex.image
            found.append(Sample(id=sample_id, key=f"toy-vlm-scene:{SPLIT}:{self.seed}:{ex.index}", ids=[],
                                position=vlm.prompt_length(ex.question) + mark, text=text,
                                span=(at, at + len(vlm.ANSWER_MARK)), prompt_chars=len(prompt),
                                labels={"colour": asked.colour, "shape": asked.shape, "question": ex.qtype}))
            if on_progress:
                on_progress("scenes", len(found), self.n)
            if len(found) == self.n:
                return found
        raise AssertionError("unreachable: the scene stream is endless")

    def read(self, backend: Backend, samples: Sequence[Sample], site: str) -> torch.Tensor:
        rows = []
        for s in samples:
            if s.id not in self._images:
                raise BadInputError(f"sample {s.id} was not drawn by this source; call samples() first")
            acts = backend.capture(s.text, [site], images=[self._images[s.id]])
            rows.append(acts[site][s.position].float().reshape(-1))
        return torch.stack(rows)
