"""`memfit trace`: the exact tensor memory of a real training step, run on fake tensors (no GPU, no weights).

`from memfit.trace import trace` imports torch only when `trace` is first used, so `import memfit` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .run import trace
    from .timeline import TraceProgress

__all__ = ["TraceProgress", "trace"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'memfit.trace' has no attribute {name!r}")
    try:
        from . import run, timeline
    except ImportError as error:
        from ..errors import MissingDependencyError

        raise MissingDependencyError(f"memfit trace needs torch ({error.name or error}): "
                                     "pip install 'memfit[torch]'") from error
    return run.trace if name == "trace" else timeline.TraceProgress
