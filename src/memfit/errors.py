"""One exception hierarchy. Every user mistake is a MemfitError whose message is one line naming the fix."""


class MemfitError(Exception):
    """Base class for every error memfit raises on purpose."""


class ConfigError(MemfitError, ValueError):
    """A training setup, hardware description or option that cannot be right (zero sizes, ZeRO on one GPU...)."""


class UnknownNameError(MemfitError, KeyError):
    """A model or GPU name that is not in the catalog; the message lists the closest matches."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ModelSourceError(MemfitError):
    """A model that cannot be resolved: malformed config.json, hub offline, unsupported architecture."""


class MissingDependencyError(MemfitError, ImportError):
    """An optional dependency (torch, transformers, deepspeed, plotly...) is needed for this feature."""


def suggest(name: str, choices: list[str], what: str) -> UnknownNameError:
    """An UnknownNameError for `name` that lists the closest of `choices`."""
    import difflib

    lowered = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=3, cutoff=0.4)
    if not close:
        close = [c for c in lowered if name.lower() in c][:3]
    hint = f" Did you mean: {', '.join(lowered[c] for c in close)}?" if close else ""
    return UnknownNameError(f"unknown {what} '{name}'.{hint} See `memfit {what}s` for the full list.")
