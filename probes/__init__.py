"""probes: everything that touches a model (zoo, sites, hooks, engine, interventions, server, client)."""

from probes.engine import Engine, GenerationStream, PrefixState, Sampling
from thoughtscope.errors import BadInputError, ThoughtscopeError, UnknownModelError, UnknownSiteError
from probes.backend import Backend, open_backend, require
from probes.interventions import KINDS, AddVector, HeadAblation, MaskAttention, ProjectionRescale, load_vector
from probes.kv_policy import HeadBudget, KeepAll, KVPolicy, SinkRecent
from probes.records import TokenRecord, Trace
from probes.zoo import ModelHandle, load_model

__all__ = [
    "KINDS", "Backend", "HeadBudget", "KVPolicy", "KeepAll", "SinkRecent", "open_backend", "require",
    "AddVector", "BadInputError", "Engine", "GenerationStream", "HeadAblation", "MaskAttention",
    "ModelHandle", "PrefixState", "ProjectionRescale", "Sampling", "ThoughtscopeError", "TokenRecord",
    "Trace", "UnknownModelError", "UnknownSiteError", "load_model", "load_vector",
]
