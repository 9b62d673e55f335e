"""The on-disk store of traces and activations: SQLite index plus safetensors shards."""

from cache.store import ActivationStore, Entry, EntryInfo, default_root, make_key

__all__ = ["ActivationStore", "Entry", "EntryInfo", "default_root", "make_key"]
