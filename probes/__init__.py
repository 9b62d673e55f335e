"""probes: everything that touches a model (zoo, sites, hooks, engine, interventions, server, client)."""

from probes.engine import Engine, GenerationStream, PrefixState, Sampling
from thoughtscope.errors import BadInputError, ThoughtscopeError, UnknownModelError, UnknownSiteError
from probes.interventions import AddVector, HeadAblation, MaskAttention, ProjectionRescale, load_vector
from probes.records import TokenRecord, Trace
from probes.zoo import ModelHandle, load_model

__all__ = [
    "AddVector", "BadInputError", "Engine", "GenerationStream", "HeadAblation", "MaskAttention",
    "ModelHandle", "PrefixState", "ProjectionRescale", "Sampling", "ThoughtscopeError", "TokenRecord",
    "Trace", "UnknownModelError", "UnknownSiteError", "load_model", "load_vector",
]
