"""KV-cache policies and the compressed cache they drive: one import for both (a thin re-export).

The policies (`KVPolicy`, `KeepAll`, `SinkRecent`, `HeadBudget`, `KnormPolicy`, `SnapKVPolicy` and
their bases) live in `probes.kv_policies`; the compressed cache, its layers and the attention
switch in `probes.kv_cache`. Code written against `probes.kv_policy` keeps working unchanged.
"""

from probes.kv_cache import (  # noqa: F401
    ATTENTION_NAME, SUPPORTED_MODEL_TYPES, CacheView, CompressedCache, CompressedLayer, WindowLayer, WindowState,
    _materialised_mask, check_model, compressed_attention, kv_bytes_per_sequence, new_cache, register_attention)
from probes.kv_policies import (  # noqa: F401
    HeadBudget, KeepAll, KnormPolicy, KVPolicy, ScorerPolicy, SinkRecent, SnapKVPolicy, WindowPolicy)
