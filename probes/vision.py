"""Images in the engine: checking and decoding them, turning them into a vision-language model's
inputs, and mapping a pixel region of an image to the visual tokens that carry it.

A prompt for a VLM holds the model's image placeholder (`<image>`) once per image, where the image
goes; the engine expands each placeholder into the model's image tokens (`expand`) and computes
the pixel inputs (`pixel_inputs`). Three families are supported, each with its own token layout:

- `llava` (`LlavaForConditionalGeneration`: LLaVA-1.5, the toy-vlm): a square image of
  `image_size` pixels cut into `patch_size` patches, one token per patch in reading order (plus the
  CLS token first when `vision_feature_select_strategy == "full"`).
- `idefics3` (`Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`): the same
  patches merged `scale_factor` x `scale_factor` by the connector's pixel shuffle, so one token
  covers a block of patches; the tokens sit between `<fake_token_around_image><global-img>` and
  `<fake_token_around_image>` (one global image, no splitting into tiles).
- `qwen2_vl` (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`,
  `Qwen3VLForConditionalGeneration`; `VisionSpec.model_type` says which): `patch_size` patches of one
  square input (their processors' flat patch layout, `qwen2_vl_patches`), merged `spatial_merge_size`
  x `spatial_merge_size` into one token, between `<|vision_start|>` and `<|vision_end|>`. The towers
  differ inside (Qwen2.5-VL: window attention; Qwen3-VL: learned position grid and DeepStack features
  added to the first language layers' outputs at the image tokens), not in their inputs. Their
  rotary positions are 3-D (temporal, height, width): the engine's decoding loop feeds the model's
  own `get_rope_index` positions (`mrope_positions`) and steps every axis by one per new token; a
  teacher-forced pass lets the model compute them; text computed after an image from a prefix state
  (forks, extensions, `capture_batch` tails) sits at its index plus the image's offset
  (`mrope_offset`, from the same function), as Hugging Face's own decoding puts it.

Our preprocessing, not the HF processors': every image is resized (bicubic, no crop) to the tower's
square input and normalised with the model's mean and std, so every pixel is seen and a pixel box
maps to tokens by scaling alone (`box_tokens`). Other VLM families are refused at load.

Images travel as bytes: in-process as PIL images, uint8 arrays or encoded bytes, through the model
server as base64 PNG strings (`image_to_b64`); a path on the server's disk is never accepted.

Example:
    >>> import numpy as np
    >>> spec = VisionSpec("llava", image_token_id=7, image_size=48, patch_size=16)
    >>> ids, groups = expand(spec, [1, 7, 9], 1)
    >>> len(ids), groups[0][:3]
    (11, [1, 2, 3])
    >>> box_tokens(spec, ids, (0, 0, 20, 10), (48, 48))  # top-left and top cells
    [1, 2]
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from thoughtscope.errors import BadInputError

MAX_IMAGE_BYTES = 8 * 1024 * 1024  # encoded size (a server request body is 8 MiB by default)
MAX_IMAGE_SIDE = 4096
MAX_IMAGE_PIXELS = MAX_IMAGE_SIDE * MAX_IMAGE_SIDE  # one image, as its header declares it
MAX_IMAGES = 16  # per request
# Modes converted to RGB; anything else (16-bit, float, CMYK, ...) is refused with a message.
ACCEPTED_MODES = ("RGB", "RGBA", "L", "LA", "P")
FAMILY_OF_MODEL_TYPE = {"llava": "llava", "idefics3": "idefics3", "smolvlm": "idefics3", "qwen2_vl": "qwen2_vl",
                        "qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen2_vl"}
# Qwen-VL models take any size; the engine feeds one square side: this many tokens per side unless the config
# names another input side (`thoughtscope_image_size`, how the tiny test configs keep their 4 x 4 tokens).
QWEN2_VL_GRID = 16
# the image mean/std of each Qwen-VL processor, used when a model folder holds no processor file
QWEN_DEFAULT_NORMALISATION = {"qwen2_vl": "clip", "qwen2_5_vl": "clip", "qwen3_vl": "half"}
IMAGE_PLACEHOLDER = "<image>"


# ----- images: check, decode, encode -------------------------------------------------------------


def load_image(image: Any):
    """An RGB `PIL.Image` from a PIL image, a uint8 array (HxW or HxWx3/4), encoded bytes (PNG, JPEG,
    ...) or a base64 string of them (a `data:image/...;base64,` prefix is allowed). Checks size and
    mode from the header before decoding a single pixel (a small file may declare a huge image);
    raises `BadInputError` for anything else (paths included: images travel as bytes)."""
    from PIL import Image

    img = open_image(image)
    if isinstance(image, (bytes, bytearray, str)):
        try:
            img.load()
        except Image.DecompressionBombError as err:
            raise _bomb(err) from err
        except (OSError, ValueError) as err:
            raise BadInputError(f"these bytes are not an image PIL can read ({err.__class__.__name__}); "
                                "send PNG or JPEG bytes") from err
    return img if img.mode == "RGB" else img.convert("RGB")


def open_image(image: Any, check: bool = True):
    """The `PIL.Image` of any accepted form, with its declared size and mode checked unless `check` is
    False; encoded bytes are opened lazily (PIL reads the header only): nothing is decoded until `.load()`."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        img = image
    elif isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (3, 4)):
            raise BadInputError(f"an image array must be uint8 HxW, HxWx3 or HxWx4; got {image.dtype} {image.shape}")
        if check:
            check_image_size(image.shape[1], image.shape[0])  # before fromarray copies it
        img = Image.fromarray(image)
    elif isinstance(image, (bytes, bytearray, str)):
        data = _b64_bytes(image) if isinstance(image, str) else bytes(image)
        if len(data) > MAX_IMAGE_BYTES:
            raise BadInputError(f"the image is {len(data)} bytes encoded; the limit is {MAX_IMAGE_BYTES} "
                                "(send a smaller or compressed image)")
        try:
            with warnings.catch_warnings():  # PIL warns of a "decompression bomb"; our size check below refuses it
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                img = Image.open(io.BytesIO(data))  # lazy: the header only
        except Image.DecompressionBombError as err:  # PIL's own limit (twice Image.MAX_IMAGE_PIXELS), from the header
            raise _bomb(err) from err
        except (UnidentifiedImageError, OSError, ValueError) as err:
            raise BadInputError(f"these bytes are not an image PIL can read ({err.__class__.__name__}); "
                                "send PNG or JPEG bytes") from err
    else:
        raise BadInputError(f"an image is a PIL image, a uint8 array, PNG/JPEG bytes or base64 of them; "
                            f"got {type(image).__name__} (paths are not accepted: send the bytes)")
    if not check:
        return img
    check_image_size(*img.size)
    if img.mode not in ACCEPTED_MODES:
        raise BadInputError(f"image mode {img.mode!r} is not supported; convert it to RGB "
                            f"(accepted modes: {', '.join(ACCEPTED_MODES)})")
    return img


def _bomb(err: Exception) -> BadInputError:
    return BadInputError(f"the image declares more pixels than it is safe to decode (a decompression bomb: {err}); "
                         f"an image may have at most {MAX_IMAGE_PIXELS} pixels, {MAX_IMAGE_SIDE} per side (resize it)")


def check_image_size(width: int, height: int, max_side: int = MAX_IMAGE_SIDE,
                     max_pixels: int = MAX_IMAGE_PIXELS) -> None:
    """Refuse an image by the size it declares: each side 1..max_side, at most max_pixels in all."""
    if not (1 <= width <= max_side and 1 <= height <= max_side):
        raise BadInputError(f"the image is {width}x{height}; each side must be 1..{max_side} pixels (resize it)")
    if width * height > max_pixels:
        raise BadInputError(f"the image is {width}x{height} = {width * height} pixels; the limit is {max_pixels} "
                            "per image (resize it)")


def _b64_bytes(text: str) -> bytes:
    if text.startswith("data:"):
        text = text.partition(",")[2]
    if len(text) > MAX_IMAGE_BYTES * 4 // 3 + 8:
        raise BadInputError(f"the base64 image is longer than the {MAX_IMAGE_BYTES}-byte limit allows")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise BadInputError("an image string must be base64-encoded image bytes (paths are not accepted)") from err


def image_to_b64(image: Any) -> str:
    """Base64 PNG of an image (how images travel to the model server)."""
    buf = io.BytesIO()
    load_image(image).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def image_size(image: Any) -> tuple[int, int]:
    """(width, height) of an image in any accepted form (read from the header: nothing is decoded)."""
    return open_image(image).size


# ----- the token layout of one VLM family ------------------------------------------------------------


@dataclass(frozen=True)
class VisionSpec:
    """How one model sees an image: family, its image token, input side, patch size, how many patches
    one token covers per side (`merge`), tokens before the patch tokens (`lead`: CLS), the token ids
    wrapped around each image (`before`, `after`), and the normalisation."""

    family: str
    image_token_id: int
    image_size: int
    patch_size: int
    merge: int = 1
    lead: int = 0
    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    placeholder: str = IMAGE_PLACEHOLDER
    extras: dict[str, Any] = field(default_factory=dict, compare=False)
    model_type: str = ""  # the HF model type (qwen2_vl, qwen2_5_vl, qwen3_vl, ...); "" when built by hand

    @property
    def mrope(self) -> bool:
        """3-D rotary positions (the Qwen-VL families): text after an image sits at an offset."""
        return self.family == "qwen2_vl"

    @property
    def grid(self) -> int:
        """Tokens per side of the image."""
        return self.image_size // self.patch_size // self.merge

    @property
    def n_tokens(self) -> int:
        """Image tokens per image."""
        return self.lead + self.grid * self.grid

    @property
    def cell(self) -> float:
        """Side, in input pixels, of the square one token covers."""
        return self.image_size / self.grid

    def to_dict(self) -> dict[str, Any]:
        # the fields are scalars and flat tuples: read directly, asdict's deep copy costs more than the
        # rest of info(), which spec_of calls once per analysis call
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in fields(self) if f.name != "extras"}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "VisionSpec":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def vision_spec(model: Any, tokenizer: Any) -> VisionSpec | None:
    """The `VisionSpec` of a loaded model, None for a text-only model. An unsupported VLM raises."""
    from thoughtscope.errors import ModelLoadError

    config = model.config
    if getattr(config, "vision_config", None) is None:
        return None
    model_type = config.model_type
    family = FAMILY_OF_MODEL_TYPE.get(model_type)
    if family is None:
        raise ModelLoadError(f"{model_type} vision-language models are not supported by the engine; it runs "
                             f"{', '.join(sorted(FAMILY_OF_MODEL_TYPE))} (LLaVA, Idefics3/SmolVLM, Qwen2-VL, "
                             "Qwen2.5-VL, Qwen3-VL)")
    vc = config.vision_config
    mean, std = _normalisation(config)
    if family == "llava":
        if not isinstance(config.vision_feature_layer, int):
            raise ModelLoadError("Llava with several vision feature layers is not supported")
        lead = 1 if config.vision_feature_select_strategy == "full" else 0
        return VisionSpec("llava", int(config.image_token_id), int(vc.image_size), int(vc.patch_size), 1, lead,
                          mean=mean, std=std, model_type=model_type)
    if family == "qwen2_vl":
        merge, patch = int(vc.spatial_merge_size), int(vc.patch_size)
        if int(vc.temporal_patch_size) < 1:
            raise ModelLoadError(f"{model_type} with temporal_patch_size < 1 is not supported")
        side = int(getattr(config, "thoughtscope_image_size", 0) or patch * merge * QWEN2_VL_GRID)
        if side % (patch * merge):
            raise ModelLoadError(f"{model_type} input side {side} is not a multiple of patch x merge = {patch * merge}")
        if (mean == (0.5, 0.5, 0.5) and std == (0.5, 0.5, 0.5) and getattr(config, "thoughtscope_image_size", 0) == 0
                and QWEN_DEFAULT_NORMALISATION[model_type] == "clip"):
            mean, std = OPENAI_CLIP_MEAN, OPENAI_CLIP_STD  # Qwen2-VL's and Qwen2.5-VL's processor default
        placeholder = tokenizer.convert_ids_to_tokens(int(config.image_token_id))
        return VisionSpec("qwen2_vl", int(config.image_token_id), side, patch, merge, 0,
                          (int(config.vision_start_token_id),), (int(config.vision_end_token_id),), mean=mean, std=std,
                          placeholder=placeholder, extras={"temporal_patch_size": int(vc.temporal_patch_size)},
                          model_type=model_type)
    fake = tokenizer.convert_tokens_to_ids("<fake_token_around_image>")
    glob = tokenizer.convert_tokens_to_ids("<global-img>")
    if fake is None or glob is None or fake == tokenizer.unk_token_id or glob == tokenizer.unk_token_id:
        raise ModelLoadError("this Idefics3/SmolVLM tokenizer lacks <fake_token_around_image> or <global-img>")
    return VisionSpec("idefics3", int(config.image_token_id), int(vc.image_size), int(vc.patch_size),
                      int(config.scale_factor), 0, (fake, glob), (fake,), mean=mean, std=std, model_type=model_type)


OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _normalisation(config: Any) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The image mean/std saved beside a model folder's weights (HF processor files), else 0.5/0.5."""
    folder = Path(str(getattr(config, "_name_or_path", "") or ""))
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = folder / name
        if folder.parts and path.is_file():
            try:
                d = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            d = d.get("image_processor", d)
            if "image_mean" in d and "image_std" in d:
                return tuple(float(v) for v in d["image_mean"]), tuple(float(v) for v in d["image_std"])
    return (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)


# ----- prompts: placeholders -> image tokens ----------------------------------------------------------


def expand(spec: VisionSpec, ids: Sequence[int], n_images: int) -> tuple[list[int], list[list[int]]]:
    """Replace each placeholder token in `ids` by the image's tokens; return the new ids and, per
    image, the positions of its image tokens. Ids already expanded (a generated sequence fed back)
    are returned as they are. The placeholder count must equal `n_images`."""
    ids = [int(i) for i in ids]
    groups = image_token_groups(spec, ids, check=False)
    if groups and all(len(g) == spec.n_tokens for g in groups):
        if len(groups) != n_images:
            raise BadInputError(f"the prompt holds {len(groups)} expanded images but {n_images} images were given")
        return ids, groups
    n_place = ids.count(spec.image_token_id)
    if n_place != n_images:
        raise BadInputError(f"the prompt holds {n_place} image placeholders ({spec.placeholder!r}) but {n_images} "
                            f"images were given: put {spec.placeholder} in the prompt once per image, where it goes")
    out: list[int] = []
    groups = []
    for i in ids:
        if i != spec.image_token_id:
            out.append(i)
            continue
        out.extend(spec.before)
        groups.append(list(range(len(out), len(out) + spec.n_tokens)))
        out.extend([spec.image_token_id] * spec.n_tokens)
        out.extend(spec.after)
    return out, groups


def image_token_groups(spec: VisionSpec, ids: Sequence[int], check: bool = True) -> list[list[int]]:
    """Positions of each image's tokens in an expanded sequence (runs of the image token)."""
    groups: list[list[int]] = []
    prev = -2
    for p, i in enumerate(ids):
        if int(i) != spec.image_token_id:
            continue
        if p == prev + 1 and groups and len(groups[-1]) < spec.n_tokens:
            groups[-1].append(p)
        else:
            groups.append([p])
        prev = p
    if check and any(len(g) != spec.n_tokens for g in groups):
        raise BadInputError(f"this sequence is not expanded: each image takes {spec.n_tokens} image tokens")
    return groups


def pixel_inputs(spec: VisionSpec, images: Sequence[Sequence[Any]], dtype: torch.dtype = torch.float32,
                 device: Any = "cpu") -> dict[str, torch.Tensor]:
    """Model keyword inputs for a batch: `images[b]` are the images of sequence b, in prompt order."""
    rows = [[preprocess(spec, im) for im in row] for row in images]
    if spec.family == "qwen2_vl":
        flat = [x for row in rows for x in row]
        if not flat:
            return {}
        t = int(spec.extras.get("temporal_patch_size", 2))
        patches = torch.cat([qwen2_vl_patches(x, spec.patch_size, spec.merge, t) for x in flat])
        g = spec.image_size // spec.patch_size
        return {"pixel_values": patches.to(device, dtype),
                "image_grid_thw": torch.tensor([[1, g, g]] * len(flat), dtype=torch.long, device=device)}
    if spec.family == "llava":
        flat = [x for row in rows for x in row]
        if not flat:
            return {}
        return {"pixel_values": torch.stack(flat).to(device, dtype)}
    most = max((len(row) for row in rows), default=0)
    if not most:
        return {}
    # Idefics3/SmolVLM take [batch, images, ...]: a row with fewer images is filled with all-zero images,
    # which the model drops (its `real_images_inds`), so rows with and without images share one batch
    blank = torch.zeros(3, spec.image_size, spec.image_size)
    pv = torch.stack([torch.stack(row + [blank] * (most - len(row))) for row in rows])
    return {"pixel_values": pv.to(device, dtype),
            "pixel_attention_mask": torch.ones(pv.shape[0], pv.shape[1], *pv.shape[-2:], dtype=torch.bool,
                                               device=device)}


def qwen2_vl_patches(x: torch.Tensor, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """[3, S, S] pixels -> Qwen2-VL's flat patches [(S/patch)^2, 3 * temporal * patch^2], ordered as its
    processor orders them (merge x merge blocks of patches together, the one frame repeated `temporal`
    times), so the merged tokens come in reading order of (S/patch/merge)^2 blocks."""
    c, h, w = x.shape
    gh, gw = h // patch, w // patch
    p = x.reshape(c, gh // merge, merge, patch, gw // merge, merge, patch).permute(1, 4, 2, 5, 0, 3, 6)
    p = p.unsqueeze(5).expand(-1, -1, -1, -1, -1, temporal, -1, -1)
    return p.reshape(gh * gw, c * temporal * patch * patch)


def mrope_positions(model: Any, input_ids: torch.Tensor, mask: torch.Tensor, vision: dict[str, Any],
                    spec: VisionSpec) -> torch.Tensor:
    """Qwen2-VL's 3-D rotary positions [3, batch, seq] for a left-padded prompt batch holding images
    (the model's own `get_rope_index`); text positions after an image continue from the image's
    largest position, so a decode step's position is the last one + 1 on every axis."""
    types = (input_ids == spec.image_token_id).to(torch.int)
    positions, _ = model.model.get_rope_index(input_ids, mm_token_type_ids=types, image_grid_thw=vision["image_grid_thw"],
                                              attention_mask=mask)
    return positions


def mrope_offset(model: Any, spec: VisionSpec | None, ids: Sequence[int]) -> int:
    """How far the 3-D rotary position of the token after `ids` sits from its index (`len(ids)`): the
    model's own `get_rope_index` over `ids` with each whole image's grid (0 without images or for a
    1-D-position family). Text computed after `ids` from a prefix state sits at index + offset on
    every axis, as in Hugging Face's decoding (its `rope_deltas`). `ids` ending inside an image is
    refused: the model has no position for text there."""
    if spec is None or not spec.mrope or spec.image_token_id not in ids:
        return 0
    groups = image_token_groups(spec, ids, check=False)
    if len(groups[-1]) != spec.n_tokens or any(len(g) != spec.n_tokens for g in groups):
        raise BadInputError("this cut falls inside an image: a model with 3-D rotary positions (Qwen-VL) has no "
                            "position for text there; fork or extend from before the image or after its last "
                            "image token")
    g = spec.image_size // spec.patch_size
    row = torch.tensor([list(ids)])
    grid = torch.tensor([[1, g, g]] * len(groups))
    positions, _ = model.model.get_rope_index(row, mm_token_type_ids=(row == spec.image_token_id).to(torch.int),
                                              image_grid_thw=grid)
    return int(positions.max()) + 1 - len(ids)


def preprocess(spec: VisionSpec, image: Any) -> torch.Tensor:
    """[3, S, S] normalised pixels: resized (bicubic, no crop) to the tower's input side."""
    from PIL import Image

    img = load_image(image)
    s = spec.image_size
    if img.size != (s, s):
        img = img.resize((s, s), Image.Resampling.BICUBIC)
    # channels first before the arithmetic: the same float64 operations per pixel (so the same values),
    # but over rows of S * S pixels instead of rows of 3 channels (numpy's broadcast over a last axis of
    # 3 costs more than the resize at toy sizes)
    x = np.ascontiguousarray(np.asarray(img).transpose(2, 0, 1), dtype=np.float64) / 255.0
    x -= np.asarray(spec.mean, dtype=np.float64)[:, None, None]
    x /= np.asarray(spec.std, dtype=np.float64)[:, None, None]
    return torch.from_numpy(x.astype(np.float32))


# ----- regions -> visual tokens -----------------------------------------------------------------------


def box_cells(spec: VisionSpec, box: Sequence[float], size: tuple[int, int]) -> list[int]:
    """Token cells (reading order, 0..grid^2-1) a pixel box (x0, y0, x1, y1; exclusive ends) of an
    image of `size` (width, height) overlaps, after the resize to the tower's input (the same cells as
    probes.image_regions.region_cells, which also takes masks, coverage thresholds and checks NaN)."""
    if len(box) != 4:
        raise BadInputError(f"a box is (x0, y0, x1, y1) in pixels; got {box!r}")
    x0, y0, x1, y1 = (float(v) for v in box)
    w, h = size
    if not (0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h):
        raise BadInputError(f"box {tuple(box)} is not a non-empty region inside the {w}x{h} image")
    sx, sy = spec.image_size / w, spec.image_size / h
    c = spec.cell
    # in token units, rounded so that an edge on a token edge stays on it (50 of 100 pixels -> 8.000000000000002)
    a0, a1, b0, b1 = (round(v, 9) for v in (x0 * sx / c, x1 * sx / c, y0 * sy / c, y1 * sy / c))
    cols = range(int(a0 // 1), min(spec.grid, int(-(-a1 // 1))))
    rows = range(int(b0 // 1), min(spec.grid, int(-(-b1 // 1))))
    return [r * spec.grid + col for r in rows for col in cols]


def box_tokens(spec: VisionSpec, ids: Sequence[int], box: Sequence[float], size: tuple[int, int],
               image_index: int = 0) -> list[int]:
    """Positions in the expanded sequence `ids` of the visual tokens covering a pixel box of image
    `image_index` (of `size` = (width, height) pixels as given to the model)."""
    groups = image_token_groups(spec, ids)
    if not 0 <= image_index < len(groups):
        raise BadInputError(f"image {image_index} is not in this sequence (it holds {len(groups)} images)")
    group = groups[image_index]
    return [group[spec.lead + k] for k in box_cells(spec, box, size)]


def cell_boxes(spec: VisionSpec, size: tuple[int, int]) -> list[tuple[int, int, int, int]]:
    """The pixel box (in the original image) of each token cell, reading order."""
    w, h = size
    g = spec.grid
    return [(round(c * w / g), round(r * h / g), round((c + 1) * w / g), round((r + 1) * h / g))
            for r in range(g) for c in range(g)]


def spec_of(backend: Any) -> VisionSpec:
    """The `VisionSpec` of a backend's model (from `info()["vision"]`, so it works through a server)."""
    d = backend.info().get("vision")
    if not d:
        raise BadInputError(f"{backend.info().get('model_id', 'this model')} is a text-only model: it takes no "
                            "images (use a VLM such as toy-vlm or tiny-random:llava)")
    return VisionSpec.from_dict(d)


def prepare(spec: VisionSpec | None, model_id: str, rows: Sequence[list[int]], images: Any,
            dtype: torch.dtype = torch.float32, device: Any = "cpu") -> tuple[list[list[int]], dict[str, Any]]:
    """(expanded ids per row, model keyword inputs) for rows of token ids and their images.

    `images` is None, or one entry per row: an image or a list of images. Every check runs here,
    before any model work."""
    if images is None:
        return [list(r) for r in rows], {}
    if spec is None:
        raise BadInputError(f"{model_id} is a text-only model: it takes no images "
                            "(use a VLM such as toy-vlm or tiny-random:llava)")
    if isinstance(images, (str, bytes)) or not isinstance(images, (list, tuple)):
        raise BadInputError("images must be a list: one image (or a list of images) per prompt")
    if len(images) != len(rows):
        raise BadInputError(f"{len(images)} image entries for {len(rows)} prompts: give one per prompt")
    # a row's entry: an image, a list of images, or None / [] for a row without images
    per_row = [list(x) if isinstance(x, (list, tuple)) else [] if x is None else [x] for x in images]
    if any(len(r) > MAX_IMAGES for r in per_row):
        raise BadInputError(f"at most {MAX_IMAGES} images per prompt")
    decoded = [[load_image(im) for im in row] for row in per_row]
    out = []
    for ids, row in zip(rows, decoded):
        new, _ = expand(spec, ids, len(row))
        out.append(new)
    inputs = pixel_inputs(spec, decoded, dtype, device)
    if spec.mrope and inputs and len({len(r) for r in out}) == 1:
        # a teacher-forced pass lets the model compute its 3-D positions from these (generation passes its own)
        inputs["mm_token_type_ids"] = torch.tensor([[int(i == spec.image_token_id) for i in r] for r in out],
                                                   dtype=torch.int, device=device)
    return out, inputs


# ----- tiny random VLMs (tests only) ------------------------------------------------------------------

# `tiny-random:<name>`: a 2-layer text model of probes.zoo's tiny shape inside a 1-layer vision tower,
# 16 image tokens in a 4 x 4 grid (Llava: 32-pixel input, patch 8; SmolVLM: 64-pixel input, patch 8,
# 2 x 2 pixel shuffle; Qwen2-VL: 64-pixel input, patch 8, 2 x 2 merge, 3-D rotary positions;
# Qwen2.5-VL: the same with a 2-block tower, block 0 in 2 x 2-token windows, block 1 full;
# Qwen3-VL: the same with a 2-block tower, an 8 x 8 learned position grid, DeepStack from block 0
# into language layer 0, interleaved 3-D rotary sections).
TINY_VLMS = ("llava", "smolvlm", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def tiny_vlm(name: str, text_kwargs: dict[str, Any], tokenizer: Any, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of a random tiny VLM; `tokenizer` gains the family's image tokens."""
    import transformers

    if name == "llava":
        tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_PLACEHOLDER]})
        vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, image_size=32, patch_size=8)
        config = transformers.LlavaConfig(
            vision_config=vision, text_config=transformers.LlamaConfig(vocab_size=len(tokenizer), **text_kwargs),
            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER), image_seq_length=16,
            vision_feature_layer=-1, vision_feature_select_strategy="default")
        cls = transformers.LlavaForConditionalGeneration
    elif name == "smolvlm":
        tokenizer.add_special_tokens({"additional_special_tokens": [
            IMAGE_PLACEHOLDER, "<fake_token_around_image>", "<global-img>"]})
        vision = transformers.SmolVLMVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, image_size=64, patch_size=8)
        text = transformers.LlamaConfig(vocab_size=len(tokenizer), **text_kwargs)
        config = transformers.SmolVLMConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                                            scale_factor=2,
                                            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER))
        cls = transformers.SmolVLMForConditionalGeneration
    elif name in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        # the image token is spelt `<image>` as in the other tiny VLMs (Qwen's own is <|image_pad|>)
        tokenizer.add_special_tokens({"additional_special_tokens": [
            IMAGE_PLACEHOLDER, "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]})
        tid = tokenizer.convert_tokens_to_ids
        width = text_kwargs["hidden_size"]
        # head_dim 16: 8 rotary frequencies, split 2 (temporal) / 3 (height) / 3 (width)
        rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        tokens = dict(image_token_id=tid(IMAGE_PLACEHOLDER), vision_start_token_id=tid("<|vision_start|>"),
                      vision_end_token_id=tid("<|vision_end|>"), video_token_id=tid("<|video_pad|>"))
        patches = dict(patch_size=8, spatial_merge_size=2, temporal_patch_size=2)
        if name == "qwen2_vl":
            text = {k: v for k, v in text_kwargs.items() if k != "head_dim"}
            vision = dict(depth=1, embed_dim=32, hidden_size=width, num_heads=2, **patches)
            config_cls, cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
        elif name == "qwen2_5_vl":
            text = {k: v for k, v in text_kwargs.items() if k != "head_dim"}
            vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=width,
                          window_size=32, fullatt_block_indexes=[1], **patches)  # windows of 32 px = 2 x 2 tokens
            config_cls, cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
        else:
            text = dict(text_kwargs)
            vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=width,
                          num_position_embeddings=64, deepstack_visual_indexes=[0], **patches)
            config_cls, cls = transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration
        config = config_cls(vision_config=vision, text_config=dict(vocab_size=len(tokenizer), **text,
                                                                   rope_parameters=rope), **tokens)
        config.thoughtscope_image_size = 64  # 8 x 8 patches, 4 x 4 tokens
    else:
        from thoughtscope.errors import UnknownModelError

        raise UnknownModelError(f"unknown tiny VLM {name!r}; choose one of {TINY_VLMS}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(config).to(dtype)
    with torch.no_grad():  # peaked logits, as for probes.zoo's tiny text models
        model.get_output_embeddings().weight.mul_(40.0)
    return model, tokenizer
