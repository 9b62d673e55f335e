"""What the feature browser can run over a corpus: an SAE latent, a neuron, or any vector (steering, concept).

A direction turns the activations at its site ([n, d_model] rows) into one number per token
(`scores`) and names the vector it writes into the residual stream (`write_vector`), whose top
and bottom logits say what it promotes and suppresses (read through the unembedding without
the final norm, as Neuronpedia and SAEDashboard do).

- `SAELatent`: the latent's activation, exactly as the SAE's own `encode` computes it. Standard
  (ReLU) and JumpReLU latents depend on their own pre-activation only, so one encoder column is
  enough; other architectures (TopK...) run the whole encoder.
- `Neuron`: one coordinate of the site's activation vector (the site's basis direction). MLP
  hidden neurons are not a site the backend exposes.
- `VectorDirection`: the projection of each activation on the unit vector v/|v|.

Example:
    >>> import torch
    >>> d = VectorDirection(torch.tensor([3.0, 4.0]), "resid_post.0", "concept")
    >>> [round(x, 5) for x in d.scores(torch.tensor([[1.0, 1.0], [0.0, 5.0]])).tolist()]   # (3 + 4) / 5, 20 / 5
    [1.4, 4.0]
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from saes.io import check_fits, load_sae
from thoughtscope.errors import BadInputError

ELEMENTWISE = ("standard", "jumprelu")  # SAE architectures whose latent j depends only on its own pre-activation


@dataclass
class VectorDirection:
    """Projection on v/|v| at `site` (a steering vector, a concept vector, a probe's weights)."""

    vector: torch.Tensor
    site: str
    name: str = "vector"
    kind: str = "vector"

    def __post_init__(self) -> None:
        v = torch.as_tensor(self.vector, dtype=torch.float32).flatten()
        if not torch.isfinite(v).all() or float(v.norm()) == 0.0:
            raise BadInputError(f"the direction {self.name!r} is zero or not finite: nothing to project on")
        self.vector = v

    @property
    def unit(self) -> torch.Tensor:
        return self.vector / self.vector.norm()

    def check(self, d_model: int) -> None:
        if self.vector.numel() != d_model:
            raise BadInputError(f"the direction {self.name!r} has width {self.vector.numel()} but {self.site} has "
                                f"width {d_model}")

    def scores(self, acts: torch.Tensor) -> torch.Tensor:
        return acts.float() @ self.unit

    def write_vector(self) -> torch.Tensor:
        return self.unit

    def key(self) -> str:
        return hashlib.sha256(self.vector.numpy().tobytes()).hexdigest()[:16]

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "site": self.site, "norm": float(self.vector.norm()),
                "sha256": self.key()}


@dataclass
class Neuron:
    """Coordinate `index` of the activation at `site`."""

    index: int
    site: str
    d_model: int = 0
    kind: str = "neuron"

    def check(self, d_model: int) -> None:
        if not isinstance(self.index, int) or not 0 <= self.index < d_model:
            raise BadInputError(f"neuron {self.index} out of range; {self.site} has coordinates 0..{d_model - 1}")
        self.d_model = d_model

    def scores(self, acts: torch.Tensor) -> torch.Tensor:
        return acts[:, self.index].float()

    def write_vector(self) -> torch.Tensor:
        v = torch.zeros(self.d_model)
        v[self.index] = 1.0
        return v

    def key(self) -> str:
        return f"neuron-{self.index}"

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "index": self.index, "site": self.site}


@dataclass
class SAELatent:
    """Latent `latent` of an SAE (SAELens, see `saes.io`) trained on activations at `site`."""

    sae: Any
    latent: int
    site: str
    source: str = ""  # the folder or release it was loaded from
    kind: str = "sae"
    _w: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def check(self, d_model: int) -> None:
        check_fits(self.sae, d_model, self.site)
        n = int(self.sae.cfg.d_sae)
        if not isinstance(self.latent, int) or not 0 <= self.latent < n:
            raise BadInputError(f"latent {self.latent} out of range; this SAE has latents 0..{n - 1}")

    @property
    def architecture(self) -> str:
        return str(self.sae.cfg.architecture())

    @torch.no_grad()
    def scores(self, acts: torch.Tensor) -> torch.Tensor:
        sae, j = self.sae, self.latent
        x = acts.to(sae.W_enc.dtype)
        if self.architecture not in ELEMENTWISE:
            return sae.encode(x)[:, j].float()
        pre = sae.process_sae_in(x) @ sae.W_enc[:, j] + sae.b_enc[j]
        if self.architecture == "jumprelu":
            return (pre * (pre > sae.threshold[j])).float()
        return torch.relu(pre).float()

    def write_vector(self) -> torch.Tensor:
        return self.sae.W_dec[self.latent].detach().float().cpu()

    def key(self) -> str:
        if "sha" not in self._w:
            h = hashlib.sha256()
            for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
                h.update(getattr(self.sae, name).detach().float().cpu().numpy().tobytes())
            self._w["sha"] = h.hexdigest()[:16]
        return f"sae-{self._w['sha']}-{self.latent}"

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "latent": self.latent, "site": self.site, "source": self.source,
                "architecture": self.architecture, "d_sae": int(self.sae.cfg.d_sae), "sae_sha256": self.key()[4:20]}


def sae_latent(folder: str, latent: int, site: str) -> SAELatent:
    """An SAE latent from a SAELens folder on disk."""
    if not str(folder).strip():
        raise BadInputError("give the folder of a saved SAE (cfg.json + sae_weights.safetensors)")
    return SAELatent(load_sae(str(folder).strip()), int(latent), site, str(folder).strip())
